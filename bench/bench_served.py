"""Served throughput beside the engine's own: the engine alone, `strata engine` over HTTP, `strata serve`.

  python bench/bench_served.py [--pack P] [--device cpu|cuda] [--clients 8] [--tokens 256]
        [--batches 1,4,8] [--runs 3] [--parts engine,http,serve] [--tree DIR] [--base DIR ...]
        [--sequential] [--json FILE]

One call measures, on the same pack, prompts and flags:
- engine: the engine core in this process through the real scheduler, as bench/bench_gpu_engine.py
  measures it: B requests of a 16-token prompt, greedy, EOS ignored, tok/s = B x tokens / (time of
  1 + tokens minus time of 1), median of --runs after a warm-up; the B = 1, 1-token time is the
  prompt's own prefill (the floor under a served first token);
- http: `strata engine` as a child process, driven over HTTP on 127.0.0.1;
- serve: `strata serve` (its own engine child), driven through its public port.
The servers are started first; then each timed round of the engine at B = --clients is followed
by one round of every server, --runs times, so that a slow patch of a shared machine falls on
all of them alike (--sequential: each part alone, one after another; the engines then never
share the device's memory). --base adds another checkout's servers (a baseline) to the same
rounds. The served parts send --clients concurrent OpenAI streaming /v1/completions requests
(the same 16-token prompts as token ids, max_tokens = --tokens, ignore_eos, temperature 0, usage
included), from a light HTTP/1.1 client on one event loop in this process, and report: aggregate
tok/s (all completion tokens / wall time of the round, median of the rounds after --warmup
untimed ones), its ratio to the engine at B = --clients, time to first text p50/p99, the gap
between a request's consecutive text events at the client p50/p99, the first-text time of one
client on an idle server (median of 10), and the CPU the started server process used (in cores:
`serve` is the proxy alone, its engine child not counted). --tree runs another checkout's
strata with this same driver.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN = 16
IDLE_TTFT_TRIES = 10


# ---------------------------------------------------------------- numbers

def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


@dataclass
class Served:
    """One served part's measurements over its rounds."""

    rates: list[float] = field(default_factory=list)  # aggregate tok/s per round
    ttft: list[float] = field(default_factory=list)  # seconds, every request of every round
    gaps: list[float] = field(default_factory=list)  # seconds, between consecutive text events
    idle_ttft: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # the started server process's CPU use per round, in cores

    def row(self) -> dict:
        ms = 1000.0
        return {"tok_s": statistics.median(self.rates), "ttft_p50_ms": percentile(self.ttft, 50) * ms,
                "ttft_p99_ms": percentile(self.ttft, 99) * ms, "gap_p50_ms": percentile(self.gaps, 50) * ms,
                "gap_p99_ms": percentile(self.gaps, 99) * ms, "idle_ttft_ms": statistics.median(self.idle_ttft) * ms,
                "server_cpu": statistics.median(self.cpu) if self.cpu else float("nan")}


# ---------------------------------------------------------------- a light streaming client

class StreamFailed(Exception):
    pass


async def stream_completion(port: int, body: dict) -> tuple[list[float], int, float]:
    """POST one streaming completion; returns (arrival time of each text event, completion tokens,
    send time). HTTP/1.1 by hand so that the client's own cost per event stays small beside the
    server's (every process here shares the same few cores)."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        chunked = b"transfer-encoding: chunked" in head.lower()
        arrivals: list[float] = []
        tokens = -1
        pending = b""  # body bytes not yet split into events
        raw = b""  # bytes not yet de-chunked
        done = False
        while not done:
            data = await reader.read(65536)
            now = time.perf_counter()
            if not data:
                break
            if chunked:
                raw += data
                while True:  # take every complete chunk
                    eol = raw.find(b"\r\n")
                    if eol < 0:
                        break
                    size = int(raw[:eol].split(b";")[0], 16)
                    if len(raw) < eol + 2 + size + 2:
                        break
                    pending += raw[eol + 2:eol + 2 + size]
                    raw = raw[eol + 2 + size + 2:]
                    if size == 0:
                        done = True
                        break
            else:
                pending += data
            *events, pending = pending.split(b"\n\n")
            for ev in events:
                if ev == b"data: [DONE]":
                    done = True
                elif b'"usage":{' in ev:
                    tokens = json.loads(ev[6:])["usage"]["completion_tokens"]
                elif b'"error"' in ev[:16]:
                    raise StreamFailed(ev.decode(errors="replace"))
                elif b'"text":"' in ev and b'"text":""' not in ev:
                    arrivals.append(now)
        if status != 200:
            raise StreamFailed(f"HTTP {status}: {pending[:300]!r}")
        if not done:
            raise StreamFailed("the stream ended before [DONE]")
        return arrivals, tokens, t0
    finally:
        writer.close()


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of a process so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return None


async def one_round(port: int, prompts: list[list[int]], tokens: int, out: Served | None,
                    server_pid: int | None = None) -> float:
    """All prompts at once; returns aggregate tok/s and adds TTFT / gaps (and the server
    process's CPU use, in cores: 1.0 is one core busy the whole round) to `out`."""
    bodies = [{"prompt": p, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}} for p in prompts]
    cpu0 = cpu_seconds(server_pid)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(stream_completion(port, b) for b in bodies))
    wall = time.perf_counter() - t0
    cpu1 = cpu_seconds(server_pid)
    if out is not None and cpu0 is not None and cpu1 is not None:
        out.cpu.append((cpu1 - cpu0) / wall)
    total = 0
    for arrivals, n, sent in results:
        if n != tokens:
            raise StreamFailed(f"a request got {n} completion tokens, not {tokens}")
        total += n
        if out is not None and arrivals:
            out.ttft.append(arrivals[0] - sent)
            out.gaps.extend(b - a for a, b in zip(arrivals, arrivals[1:]))
    return total / wall


async def drive(port: int, prompts: list[list[int]], tokens: int, runs: int, warmup: int,
                server_pid: int | None = None) -> Served:
    out = Served()
    for _ in range(warmup):  # window shapes seen (and captured as CUDA graphs) before timing
        await one_round(port, prompts, tokens, None)
    for _ in range(runs):
        out.rates.append(await one_round(port, prompts, tokens, out, server_pid))
    await idle_ttft(port, prompts[0], out)
    return out


async def idle_ttft(port: int, prompt: list[int], out: Served) -> None:
    """The first-text time of one client on the idle server, IDLE_TTFT_TRIES times."""
    for _ in range(IDLE_TTFT_TRIES):
        arrivals, _, sent = await stream_completion(port, {"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                                           "ignore_eos": True, "stream": True,
                                                           "stream_options": {"include_usage": True}})
        out.idle_ttft.append(arrivals[0] - sent)


# ---------------------------------------------------------------- the engine alone

class EngineAlone:
    """The engine core of `tree` in this process, driven through the real scheduler."""

    def __init__(self, tree: Path, engine_args: list[str]):
        sys.path.insert(0, str(tree))
        from strata.engine.core import EngineCore
        from strata.engine.options import parse_engine_args
        from strata.protocol import GenerationRequest, SamplingParams

        self._request, self._params = GenerationRequest, SamplingParams
        self.core = EngineCore.load(parse_engine_args(engine_args, serving=False), log=lambda s: None)

    def timed(self, ps, n) -> float:
        """Seconds for B = len(ps) requests of n tokens each, all at once."""
        hs = [self.core.submit(self._request(list(p), self._params(max_tokens=n, temperature=0.0, ignore_eos=True)))
              for p in ps]
        t0 = time.perf_counter()
        self.core.scheduler.run_until_idle()
        dt = time.perf_counter() - t0
        for h in hs:
            h.collect()
        return dt

    def rate(self, ps, tokens: int, runs: int) -> tuple[float, float]:
        """(tok/s of B x tokens, the 1-token time): median times of 1 + tokens minus 1 token."""
        self.timed(ps, 1 + tokens)
        t1 = statistics.median(self.timed(ps, 1) for _ in range(runs))
        tn = statistics.median(self.timed(ps, 1 + tokens) for _ in range(runs))
        return len(ps) * tokens / max(tn - t1, 1e-9), t1

    def close(self) -> None:
        self.core = None  # its device memory goes back before later parts start their engines
        gc.collect()
        _free_device_memory()


def engine_alone(eng: EngineAlone, prompts, batches: list[int], tokens: int, runs: int) -> dict:
    out = {}
    for b in batches:
        out[b], t1 = eng.rate(prompts[:b], tokens, runs)
        if b == 1:
            out["prefill_ms"] = t1 * 1000.0
        print(f"[engine] B={b}: {out[b]:.1f} tok/s", flush=True)
    return out


def _free_device_memory() -> None:
    """So that the engines started next find the GPU as a fresh process would."""
    if "cupy" in sys.modules:
        cp = sys.modules["cupy"]
        cp.get_default_memory_pool().free_all_blocks()
        cp.get_default_pinned_memory_pool().free_all_blocks()


def vocab_of(tree: Path, pack: str | None) -> int:
    sys.path.insert(0, str(tree))
    from strata.defaults import default_model_path
    from strata.gguf.reader import GGUFFile

    path = Path(pack) if pack else default_model_path()
    if path.is_dir():
        path = sorted(path.glob("*.gguf"))[0]
    return len(GGUFFile(path).metadata["tokenizer.ggml.tokens"])


# ---------------------------------------------------------------- served parts

class Child:
    """`python -m strata.cli.main <command> ...` of `tree`, its output kept for errors."""

    def __init__(self, tree: Path, command: str, args: list[str], profile: Path | None = None):
        env = dict(os.environ)
        env["PYTHONPATH"] = str(tree) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["PYTHONUNBUFFERED"] = "1"
        flags = ({"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP} if sys.platform == "win32"
                 else {"start_new_session": True})
        # cProfile sees the main thread: the event loop, where the served path's Python work runs
        run = ["-m", "cProfile", "-o", str(profile), "-m"] if profile else ["-m"]
        # cwd: `python -m` puts the working directory first on sys.path, before PYTHONPATH
        self.proc = subprocess.Popen([sys.executable, *run, "strata.cli.main", command, *args], env=env, cwd=str(tree),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **flags)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.port = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip()
            self.lines.append(line)
            if not self.port and (m := re.search(r"listening on http://[\d.]+:(\d+)", line)):
                self.port = int(m.group(1))
            if re.search(r"engine: ready|serve: engine ready", line):
                self.ready.set()
        self.ready.set()

    def wait_ready(self, timeout: float) -> int:
        if not self.ready.wait(timeout) or self.proc.poll() is not None or not self.port:
            raise SystemExit("the server did not become ready; its output:\n" + "\n".join(self.lines[-30:]))
        return self.port

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.CTRL_BREAK_EVENT if sys.platform == "win32" else signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_server(tree: Path, part: str, engine_args: list[str], clients: int, profile_dir: str = "") -> Child:
    profile = Path(profile_dir).resolve() / f"{part}.prof" if profile_dir else None
    if part == "http":
        return Child(tree, "engine", [*engine_args, "--port", "0", "--max-queued", str(4 * clients)], profile)
    cfg = {"parallel": clients, "max_queued": 4 * clients, "args": engine_args}
    path = Path(tempfile.mkdtemp()) / "serve.json"
    path.write_text(json.dumps(cfg))
    return Child(tree, "serve", ["--config", str(path), "--port", "0"], profile)


def report(part: str, child: Child, out: Served, profile_dir: str = "") -> dict:
    child.stop()
    profile = Path(profile_dir).resolve() / f"{part}.prof" if profile_dir else None
    if profile is not None and profile.is_file():
        import pstats
        print(f"[{part}] where the server's event loop spent its time (cProfile, top 25 by own time):")
        pstats.Stats(str(profile)).sort_stats("tottime").print_stats(25)
    row = out.row()
    print(f"[{part}] {row['tok_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:.1f} ms, "
          f"gap p50/p99 {row['gap_p50_ms']:.2f}/{row['gap_p99_ms']:.2f} ms, idle TTFT {row['idle_ttft_ms']:.1f} ms, "
          f"server CPU {row['server_cpu']:.2f} cores",
          flush=True)
    return row


def served(tree: Path, part: str, engine_args: list[str], clients: int, prompts, tokens: int, runs: int,
           warmup: int, timeout: float, profile_dir: str = "") -> dict:
    """One served part alone: its server started, warmed, driven for `runs` rounds, stopped."""
    child = start_server(tree, part, engine_args, clients, profile_dir)
    try:
        port = child.wait_ready(timeout)
        out = asyncio.run(drive(port, prompts[:clients], tokens, runs, warmup, child.proc.pid))
    except (OSError, StreamFailed):
        print(f"[{part}] the server's output:\n" + "\n".join(child.lines[-30:]), file=sys.stderr)
        child.stop()
        raise
    return report(part, child, out, profile_dir)


def interleaved(eng: EngineAlone, servers: dict[str, Child], prompts, tokens: int, runs: int, warmup: int,
                timeout: float) -> tuple[float, dict[str, Served]]:
    """The engine alone at B = clients and every server, one round each in turn, `runs` times:
    a slow patch of a shared machine falls on all of them alike. Returns the engine's tok/s
    (median times of 1 + tokens minus 1 token) and each server's rounds."""
    ports = {name: child.wait_ready(timeout) for name, child in servers.items()}
    outs = {name: Served() for name in servers}

    async def rounds() -> list[float]:
        for name, port in ports.items():
            for _ in range(warmup):
                await one_round(port, prompts, tokens, None)
        times = []
        for _ in range(runs):
            times.append(eng.timed(prompts, 1 + tokens))
            for name, port in ports.items():
                outs[name].rates.append(await one_round(port, prompts, tokens, outs[name], servers[name].proc.pid))
        for name, port in ports.items():
            await idle_ttft(port, prompts[0], outs[name])
        return times

    eng.timed(prompts, 1 + tokens)
    t1 = statistics.median(eng.timed(prompts, 1) for _ in range(runs))
    try:
        times = asyncio.run(rounds())
    except (OSError, StreamFailed):
        for name, child in servers.items():
            print(f"[{name}] the server's output:\n" + "\n".join(child.lines[-30:]), file=sys.stderr)
            child.stop()
        raise
    return len(prompts) * tokens / max(statistics.median(times) - t1, 1e-9), outs


# ---------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pack", default=None, help="pack (default: the test model)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batches", default="1,4,8", help="engine-alone batch sizes")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds before the timed ones (served parts)")
    ap.add_argument("--parts", default="engine,http,serve")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--extra", default="", help="more engine flags, for every part")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose strata runs (default: this one)")
    ap.add_argument("--label", default="", help="a name for this tree in the table")
    ap.add_argument("--base", action="append", default=[], metavar="DIR",
                    help="another checkout (a baseline) whose servers run in the same rounds; repeatable")
    ap.add_argument("--sequential", action="store_true",
                    help="one part after another (each server alone on the device) instead of interleaved rounds")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a server may take to become ready")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="run each server under cProfile (slower), write DIR/<part>.prof and print its top functions")
    a = ap.parse_args()
    tree = Path(a.tree).resolve()
    parts = a.parts.split(",")
    batches = sorted({int(b) for b in a.batches.split(",")} | {1, a.clients})
    engine_args = ["--device", a.device, "--parallel", str(max(a.clients, *batches)), "--max-context",
                   str(a.max_context), *a.extra.split()]
    if a.pack:
        engine_args = ["--pack", str(Path(a.pack).resolve()), *engine_args]

    import random
    rng = random.Random(0)
    vocab = vocab_of(tree, a.pack)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(PROMPT_LEN)] for _ in range(max(a.clients, *batches))]

    label = a.label or tree.name
    trees = [(label, tree)] + [(Path(b).resolve().name, Path(b).resolve()) for b in a.base]
    wanted = [(lab, t, p) for lab, t in trees for p in ("http", "serve") if p in parts]
    together = "engine" in parts and wanted and not a.sequential
    eng = EngineAlone(tree, engine_args) if "engine" in parts else None
    servers = {f"{lab} {p}": start_server(t, p, engine_args, a.clients, a.profile) for lab, t, p in wanted} \
        if together else {}
    try:
        for child in servers.values():  # loaded before the engine is timed: no start-up beside it
            child.wait_ready(a.timeout)
        engine = engine_alone(eng, prompts, [b for b in batches if not (together and b == a.clients)],
                              a.tokens, a.runs) if eng else {}
        if together:
            engine[a.clients], outs = interleaved(eng, servers, prompts[:a.clients], a.tokens, a.runs, a.warmup,
                                                  a.timeout)
            print(f"[engine] B={a.clients}: {engine[a.clients]:.1f} tok/s (rounds between the servers')", flush=True)
            rows = {name: report(name, servers[name], outs[name], a.profile) for name in servers}
        if eng:
            eng.close()
        if not together:
            rows = {f"{lab} {p}": served(t, p, engine_args, a.clients, prompts, a.tokens, a.runs, a.warmup, a.timeout,
                                         a.profile) for lab, t, p in wanted}
    finally:
        for child in servers.values():
            child.stop()

    ref = engine.get(a.clients)
    print()
    print(f"pack: {a.pack or 'test model'}  device: {a.device}  tree: {label}  {a.clients} clients x {a.tokens} tokens"
          f"  runs: {a.runs} after {a.warmup} warm-up round(s)" + ("" if together else ", parts one after another"))
    if engine:
        print("engine alone: " + ", ".join(f"B={b} {engine[b]:.1f}" for b in batches)
              + f" tok/s; prefill of the {PROMPT_LEN}-token prompt + 1 token: {engine['prefill_ms']:.1f} ms")
    print("| tree | part | tok/s | / engine B=%d | TTFT p50 | TTFT p99 | gap p50 | gap p99 | idle TTFT | server CPU |"
          % a.clients)
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    if ref:
        print(f"| {label} | engine alone | {ref:.1f} | 1.00 | | | | | {engine['prefill_ms']:.1f} |")
    for name, r in rows.items():
        ratio = f"{r['tok_s'] / ref:.2f}" if ref else ""
        tree_label, part = name.rsplit(" ", 1)
        print(f"| {tree_label} | {part} | {r['tok_s']:.1f} | {ratio} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
              f"{r['gap_p50_ms']:.2f} | {r['gap_p99_ms']:.2f} | {r['idle_ttft_ms']:.1f} | {r['server_cpu']:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"label": label, "pack": a.pack, "device": a.device, "clients": a.clients,
                                            "tokens": a.tokens, "engine": {str(k): v for k, v in engine.items()},
                                            "served": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
