"""Running out of memory is a request's or a pack's problem, never the engine's.

* A KV cache growth that finds no room half way leaves the cache as it was: every array at the
  one capacity it reports (the CUDA kernels index by it), its positions kept, and a new
  generation so that kept addresses are rebuilt.
* In a window, the request whose KV cache cannot grow ends (reason "error", code
  "out_of_memory", one log line) and every other request of the window goes on with the tokens
  it has alone; the server answers that request 503 with code "out_of_memory" and keeps serving.
* Loading: a pack whose weights cannot fit the device's free memory is refused before anything
  is loaded, and running out while loading is one line naming the tensor (tests/test_cuda_memory.py
  checks both on the GPU with a real memory limit).

* A served engine whose device lost its context exits (code 3) so that `strata serve` starts a
  new one (the GPU side, with a real trap: tests/test_cuda_memory.py).

The CPU runs reach the out-of-memory paths through the scheduler's fault hook
(STRATA_FAULT_INJECT="kv-grow@SLOT" raises MemoryError where that slot's cache grows).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

from strata.batch.scheduler import FaultInjector
from strata.engine.core import _check_room, _load_errors
from strata.errors import OutOfMemory
from strata.model.kv_cache import KVCache
from support.server_proc import HTTP, start_serve
from support.together import send_together
from tests.support.engines import greedy, load_engine, request
from tests.support.model_fixtures import synth_model

ROOT = Path(__file__).resolve().parents[1]


class _Tight(KVCache):
    """A KV cache whose k / v arrays share `budget` bytes (None: no limit): an allocation past
    it raises MemoryError, and an array's bytes come back when it is freed (as a pool's or
    malloc's blocks do)."""

    def __init__(self, *args, **kw):
        self.budget: int | None = None
        self.live = 0
        super().__init__(*args, **kw)

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def _rows(self, cap: int):
        a = super()._rows(cap)
        if self.budget is not None and self.live + a.nbytes > self.budget:
            raise MemoryError("no room for a KV array (test)")
        self.live += a.nbytes
        weakref.finalize(a, self._freed, a.nbytes)
        return a


@pytest.mark.parametrize("kind", ["f16", "int8"])
def test_kv_growth_out_of_memory_leaves_the_cache_as_it_was(kind):
    rng = np.random.default_rng(0)
    cache = _Tight(np, 4, 2, 8, 1024, kind, initial=16)
    k = rng.standard_normal((12, 2, 8)).astype(np.float32)
    v = rng.standard_normal((12, 2, 8)).astype(np.float32)
    for layer in range(4):
        cache.write(layer, 0, k, v)
    cache.length = 12
    before = [cache.read(layer, 12) for layer in range(4)]
    cap, gen = cache._cap, cache.generation
    # room for one array of the new capacity besides what is there: the first k array of the
    # growth fits (its predecessor then goes), the second does not
    cache.budget = cache.live + cache._rows(100).nbytes
    with pytest.raises(MemoryError):
        cache.ensure(100)
    assert cache._cap == cap and cache.generation > gen
    for arrs in (cache._k, cache._v, cache._ks, cache._vs, cache._kd, cache._vd):
        assert all(a.shape[1] == cap for a in arrs)
    for layer in range(4):
        for got, want in zip(cache.read(layer, 12), before[layer]):
            np.testing.assert_array_equal(got, want)
    cache.budget = None  # room again: the growth goes through and keeps the positions
    cache.ensure(100)
    assert cache._cap >= 100
    for layer in range(4):
        for got, want in zip(cache.read(layer, 12), before[layer]):
            np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synth_model(tmp_path_factory.mktemp("oom"), "llama")


PROMPTS = [[1, 17, 230, 45, 99, 12], [1, 300, 301, 302, 7]]


def test_a_request_whose_cache_finds_no_room_ends_alone(tiny):
    alone, _ = load_engine(["--pack", str(tiny), "--device", "cpu"])
    want = []
    for p in PROMPTS:
        h = alone.submit(request(p, greedy(12)))
        alone.scheduler.run_until_idle()
        want.append(h.collect(timeout=60)[0])
    core, lines = load_engine(["--pack", str(tiny), "--device", "cpu", "--parallel", "2"])
    core.scheduler.faults = FaultInjector("kv-grow@1")
    core.scheduler.log = lines.append
    handles = [core.submit(request(p, greedy(12))) for p in PROMPTS]  # slot 0, then slot 1
    core.scheduler.run_until_idle()
    (ids0, _, fin0), (ids1, _, fin1) = (h.collect(timeout=60) for h in handles)
    assert fin0.reason == "length" and ids0 == want[0]
    assert fin1.reason == "error" and fin1.code == "out_of_memory" and ids1 == []
    assert "KV cache could not grow" in fin1.error and "injected fault" in fin1.error
    said = [ln for ln in lines if "out of memory growing its KV cache" in ln]
    assert len(said) == 1 and "slot 1" in said[0] and "Traceback" not in "\n".join(lines)
    # the engine goes on: the next request in slot 0 gets its tokens
    h = core.submit(request(PROMPTS[1], greedy(12)))
    core.scheduler.run_until_idle()
    ids, _, fin = h.collect(timeout=60)
    assert fin.reason == "length" and ids == want[1]


# greedy and deaf to end-of-sequence: both requests of the test below run exactly this long
TWIN = {"prompt": "Once upon a time", "max_tokens": 256, "temperature": 0, "ignore_eos": True}


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="SIGSTOP is POSIX")
def test_server_answers_503_out_of_memory_and_keeps_serving(tiny, tmp_path, monkeypatch):
    """Two requests share a window: the one in slot 1 (whose KV cache cannot grow) is answered
    503 out_of_memory, the other gets every token it gets alone, and the server goes on. Slot 1
    is taken only while slot 0 is busy: both reach the engine together (support/together.py),
    and the one it starts second finds the other's 256 tokens still to come."""
    monkeypatch.setenv("STRATA_FAULT_INJECT", "kv-grow@1")
    p = start_serve(tmp_path, {"parallel": 2, "args": ["--pack", str(tiny), "--device", "cpu"]})
    try:
        p.wait_healthy()
        url = p.url + "/v1/completions"
        alone = HTTP.post(url, json=TWIN, timeout=120)  # slot 0, nobody beside it
        assert alone.status_code == 200 and alone.json()["choices"][0]["finish_reason"] == "length"
        engine = p.engine_pids()[-1]
        answers = send_together(p, [lambda: HTTP.post(url, json=TWIN, timeout=120)] * 2)
        failed, served = sorted(answers, key=lambda r: r.status_code == 200)
        assert (failed.status_code, served.status_code) == (503, 200), (failed.text, served.text)
        err = failed.json()["error"]
        assert err["type"] == "unavailable_error" and err["code"] == "out_of_memory"
        assert "KV cache could not grow" in err["message"]
        assert served.json()["choices"][0]["finish_reason"] == "length"
        assert served.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]  # the tokens it has alone
        again = HTTP.post(url, json={"prompt": "Hello", "max_tokens": 4}, timeout=120)  # slot 0 again
        assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] == "length"
        assert HTTP.get(p.url + "/health", timeout=10).status_code == 200
        assert p.engine_pids() == [engine], "the engine was restarted"
        said = [ln for ln in p.lines if "out of memory growing its KV cache" in ln]
        assert len(said) == 1 and "slot 1" in said[0] and "Traceback" not in p.output()
    finally:
        p.kill_tree()


class _Device:
    """What _check_room and _load_errors ask of a backend (a device of `free` bytes)."""

    name = "cuda"

    def __init__(self, need: int | None, free: int | None):
        self.need, self.free, self.released = need, free, 0

    def weight_bytes(self, tensors):
        return self.need

    def free_bytes(self):
        return self.free

    def is_out_of_memory(self, exc):
        return isinstance(exc, MemoryError)

    def release_cached_memory(self):
        self.released += 1


def test_a_pack_larger_than_the_free_memory_is_refused_before_loading():
    with pytest.raises(OutOfMemory, match=r"pack p\.gguf does not fit on cuda: .* 3 MiB there, 2 MiB is free"):
        _check_room(_Device(3 << 20, 2 << 20), [], "pack p.gguf")
    _check_room(_Device(2 << 20, 3 << 20), [], "pack p.gguf")  # fits
    _check_room(_Device(None, 1), [], "pack p.gguf")  # a backend that does not tell: not checked
    _check_room(_Device(1 << 30, None), [], "pack p.gguf")


def test_running_out_while_loading_is_one_line():
    dev = _Device(None, None)
    with pytest.raises(OutOfMemory, match=r"^pack p\.gguf: out of memory on cuda "
                                          r"\(MemoryError: no room; a smaller pack, or --device cpu\)$"):
        with _load_errors(dev, "pack p.gguf"):
            raise MemoryError("no room")
    assert dev.released == 1
    with pytest.raises(OutOfMemory, match=r"^draft d: out of GPU memory loading blk\.0\.x: .*--device cpu\)$"):
        with _load_errors(dev, "draft d"):
            raise OutOfMemory("out of GPU memory loading blk.0.x: 2.0 MiB needed, 1.0 MiB free")
    with pytest.raises(ValueError):  # anything else is not the user's
        with _load_errors(dev, "pack p.gguf"):
            raise ValueError("a bug")


def test_a_served_engine_that_lost_its_device_exits_to_be_started_again():
    """engine_process's on_fatal (tests/test_cuda_memory.py reaches it through a real GPU trap):
    one line, then exit code 3 once the answers have had time to go out (`strata serve` starts a
    new engine at once, as after any crash)."""
    code = ("import time\nfrom strata.server.engine_process import _exit_soon\n"
            "_exit_soon(lambda line: print(line, flush=True), 'the GPU lost its context (test)')\n"
            "print('still answering', flush=True)\ntime.sleep(30)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 3
    assert r.stdout.splitlines() == ["strata engine: the GPU lost its context (test); exiting (code 3) so that it "
                                     "can be started again", "still answering"]


def test_start_up_says_when_full_contexts_would_not_fit(tiny):
    """A sizing note, not a refusal: the caches grow as requests need them (a context that one
    slot alone cannot hold is refused: tests/test_cli_edges_context.py)."""
    core, _ = load_engine(["--pack", str(tiny), "--device", "cpu", "--max-context", "64"])
    per, free = core.scheduler.slots[0].cache.bytes_per_position, core.backend.free_bytes()
    del core
    n_ctx = free // (per * 8)  # one slot at full context: an eighth of what is free; 64 slots: 8 times it
    _, lines = load_engine(["--pack", str(tiny), "--device", "cpu", "--parallel", "64", "--max-context", str(n_ctx)])
    said = [ln for ln in lines if "KV caches at full context" in ln]
    assert len(said) == 1
    assert said[0].startswith("strata: the KV caches at full context would take ")
    assert f"(64 slot(s) x {n_ctx} tokens, --kv f16)" in said[0] and said[0].endswith("may end with out_of_memory (503)")
    _, lines = load_engine(["--pack", str(tiny), "--device", "cpu", "--parallel", "2", "--max-context", "4096"])
    assert not [ln for ln in lines if "KV caches at full context" in ln]
