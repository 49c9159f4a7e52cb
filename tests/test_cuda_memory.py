"""Out of GPU memory, for real (CuPy's pool limit: CUPY_GPU_MEMORY_LIMIT in a child process,
pool.set_limit in this one): the user gets one line or one failed request, never a traceback
or a dead engine. The CPU side of the same paths: tests/test_out_of_memory.py.

* `strata generate` on a pack larger than the memory the device has free: exit 2, one line,
  before anything is loaded.
* An upload that finds no room: OutOfMemory naming the tensor.
* A request whose KV cache cannot grow ends (out_of_memory); the request beside it keeps the
  tokens it has alone, and the slot then serves the next request right (the cache's table on
  the device is rebuilt after the failed growth).
* An MTP draft that does not fit beside the model: MTP off, said once, its partial uploads
  freed, and the engine serves.
* A device that loses its context (a real trap, STRATA_FAULT_INJECT=gpu-trap@0, in a child
  process): the window's request ends with code device_lost, the scheduler stops and calls
  on_fatal (which a served engine answers by exiting, code 3, to be started again).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.gpu import require_cuda, synth_for_gpu

cp = require_cuda()

from strata.backend.cuda import CudaBackend  # noqa: E402
from strata.errors import OutOfMemory  # noqa: E402
from tests.support.engines import greedy, load_engine, make_seed_moe, request  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # 8 layers: a KV cache doubling past 16384 positions asks for 64 MiB more, far more than a
    # window's own buffers
    return synth_for_gpu(tmp_path_factory.mktemp("oom-gpu"), "llama", n_layer=8)


@pytest.fixture
def pool_limit():
    """Sets the pool's limit (bytes beyond what is in use now: the blocks it holds free, from
    earlier tests, go back first, or they would serve past the limit); no limit afterwards."""
    pool = cp.get_default_memory_pool()

    def set_(headroom: int) -> None:
        gc.collect()
        pool.free_all_blocks()
        pool.set_limit(size=pool.total_bytes() + headroom)

    yield set_
    pool.set_limit(size=0)


def test_a_pack_larger_than_the_free_gpu_memory_is_one_line(tiny):
    env = dict(os.environ, CUPY_GPU_MEMORY_LIMIT=str(512 * 1024), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "generate", "--pack", str(tiny), "--device", "cuda",
                        "--prompt", "hi", "--max-tokens", "2"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"strata: pack {tiny} does not fit on cuda: its weights take at least ")
    assert "MiB is free (a smaller pack, or --device cpu)" in last


def test_an_upload_without_room_names_the_tensor(pool_limit):
    backend = CudaBackend()
    pool_limit(1 << 20)
    with pytest.raises(OutOfMemory, match=r"^out of GPU memory loading blk\.3\.ffn_up\.weight: 8\.0 MiB needed, "
                                          r"[0-9.]+ MiB free$"):
        backend._device(np.zeros(2 << 20, dtype=np.float32), "blk.3.ffn_up.weight")


def test_a_request_whose_kv_cache_finds_no_room_ends_alone(tiny, pool_limit):
    core, lines = load_engine(["--pack", str(tiny), "--device", "cuda", "--parallel", "2", "--max-context", "65536"])
    core.scheduler.log = lines.append
    short = [1, 17, 230, 45, 99, 12]
    h = core.submit(request(short, greedy(24)))
    core.scheduler.run_until_idle()
    want = h.collect(timeout=120)[0]
    per_token = core.scheduler.slots[0].cache.nbytes // core.scheduler.slots[0].cache._cap
    # room for the long prompt's cache at 16384 positions and 32 MiB of window buffers: its growth
    # to 32768 runs out half way (array by array), and is rolled back
    pool_limit(16384 * per_token + (32 << 20))
    rng = np.random.default_rng(0)
    long_prompt = [1] + [int(t) for t in rng.integers(2, 1000, 19999)]
    handles = [core.submit(request(short, greedy(24))), core.submit(request(long_prompt, greedy(4)))]
    core.scheduler.run_until_idle()
    (ids0, _, fin0), (ids1, _, fin1) = (x.collect(timeout=300) for x in handles)
    assert fin1.reason == "error" and fin1.code == "out_of_memory", fin1
    assert "KV cache could not grow to" in fin1.error
    assert fin0.reason == "length" and ids0 == want
    said = [ln for ln in lines if "out of memory growing its KV cache" in ln]
    assert len(said) == 1 and "slot 1" in said[0]
    # slot 1 again (slot 0 busy first): its cache, after the failed growth, serves right
    handles = [core.submit(request(short, greedy(24))), core.submit(request(short, greedy(24)))]
    core.scheduler.run_until_idle()
    for x in handles:
        ids, _, fin = x.collect(timeout=120)
        assert fin.reason == "length" and ids == want


def test_a_draft_without_room_turns_mtp_off_and_the_engine_serves(tmp_path):
    pack = make_seed_moe(tmp_path / "seed")
    pool = cp.get_default_memory_pool()
    args = ["--pack", str(pack), "--device", "cuda", "--parallel", "2"]
    gc.collect()
    pool.free_all_blocks()
    before = pool.used_bytes()
    core, _ = load_engine(args)
    model_bytes = pool.used_bytes() - before  # what the model alone takes (its 38 MB pack)
    del core
    gc.collect()
    pool.free_all_blocks()
    pool.set_limit(size=pool.total_bytes() + model_bytes + (1 << 20))  # the 3 MB draft does not fit
    try:
        core, lines = load_engine(args + ["--mtp", str(pack / "mtp"), "--spec", "2"])
        assert core.draft is None
        said = [ln for ln in lines if ln.startswith("strata mtp: draft ")]
        assert len(said) == 1 and "out of GPU memory loading" in said[0] and said[0].endswith("; MTP is off")
        assert pool.used_bytes() - before <= model_bytes + (1 << 20)  # its partial uploads are gone
        h = core.submit(request([1, 17, 230, 45], greedy(8)))
        core.scheduler.run_until_idle()
        ids, _, fin = h.collect(timeout=120)
        assert fin.reason == "length" and len(ids) == 8
    finally:
        pool.set_limit(size=0)


LOST_CONTEXT = """
import os, sys, threading
from strata.engine.core import EngineCore
from strata.engine.options import parse_engine_args
from strata.protocol import GenerationRequest, SamplingParams
core = EngineCore.load(parse_engine_args(["--pack", sys.argv[1], "--device", "cuda"], serving=False),
                       log=lambda line: print(line, flush=True))
fatal, whys = threading.Event(), []
core.scheduler.on_fatal = lambda why: (whys.append(why), fatal.set())
core.start()
h = core.submit(GenerationRequest([1, 17, 230], SamplingParams(max_tokens=8, temperature=0.0)))
ids, text, fin = h.collect(timeout=120)
print("finish:", fin.reason, fin.code, fin.error, flush=True)
assert fatal.wait(30)
print("on_fatal:", whys, flush=True)
later = core.submit(GenerationRequest([1, 17, 230], SamplingParams(max_tokens=8, temperature=0.0)))
fin = later.collect(timeout=30)[2]
print("later:", fin.reason, fin.code, flush=True)
os._exit(0)  # as the served engine does: a lost context must not run CuPy's finalizers
"""


def test_a_lost_gpu_context_ends_the_window_and_calls_on_fatal(tiny):
    env = dict(os.environ, STRATA_FAULT_INJECT="gpu-trap@0", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", LOST_CONTEXT, str(tiny)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    out = r.stdout
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in out + r.stderr
    assert "finish: error device_lost the GPU failed: " in out
    assert "strata batch: the GPU lost its context (CUDARuntimeError: " in out
    assert "on_fatal: ['the GPU lost its context (CUDARuntimeError: " in out
    assert "later: error device_lost" in out  # nothing more runs on that device


def test_generate_on_a_lost_gpu_is_one_line_and_exit_3(tiny):
    env = dict(os.environ, STRATA_FAULT_INJECT="gpu-trap@0", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "generate", "--pack", str(tiny), "--device", "cuda",
                        "--prompt", "hi", "--max-tokens", "4"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("strata: the GPU failed: ")


def test_slots_whose_kv_caches_find_no_room_at_start_are_one_line(tiny, pool_limit):
    pool = cp.get_default_memory_pool()
    gc.collect()
    pool.free_all_blocks()
    before = pool.used_bytes()
    core, _ = load_engine(["--pack", str(tiny), "--device", "cuda"])
    one = pool.used_bytes() - before  # the model and one slot's first KV block (256 positions)
    per_slot = core.scheduler.slots[0].cache.nbytes
    del core
    pool_limit(one + 4 * per_slot)  # 64 slots need 63 more
    with pytest.raises(OutOfMemory, match=r"^the KV caches of 64 slot\(s\): out of memory on cuda \(OutOfMemoryError: "):
        load_engine(["--pack", str(tiny), "--device", "cuda", "--parallel", "64"])
