"""Fused vs generic in one process: plain, with a device sync after every op, and with one op at
a time put back to the generic code (device helper)."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from strata.backend.base import Backend  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_decode import load, step_logits  # noqa: E402


fus = load(sys.argv[1], True)
ids = fus.tokenizer.encode(fus.chat.render([{"role": "user", "content": "What is the capital of France?"}]), add_special=True)
FOLLOW = [504, 3575, 282]


def run(core):
    return step_logits(core, ids, FOLLOW)


b = fus.model.b
OPS = ("rms_norm", "swiglu", "rope", "attention", "linear")
res = {"fused": run(fus)}
import cupy as cp  # noqa: E402


def synced(fn):
    def f(*a, **k):
        y = fn(*a, **k)
        cp.cuda.Device().synchronize()
        return y
    return f


for op in OPS:
    setattr(b, op, synced(getattr(b, op)))
res["fused+sync"] = run(fus)
for op in OPS:
    delattr(b, op)


def old_linear(w, x):
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    outs = [b._one(p, x) for p in w.parts]
    return outs[0] if len(outs) == 1 else cp.concatenate(outs, axis=1)


for op in OPS:
    setattr(b, op, old_linear if op == "linear" else getattr(Backend, op).__get__(b))
    res[f"fused minus {op}"] = run(fus)
    delattr(b, op)
for op in OPS[:-1]:
    for other in OPS[:-1]:
        if other != op:
            setattr(b, other, getattr(Backend, other).__get__(b))
    res[f"only {op} (+linear)"] = run(fus)
    for other in OPS[:-1]:
        if other != op:
            delattr(b, other)
res["fused again"] = run(fus)
gen = load(sys.argv[1], False)
g = run(gen)
for k, v in res.items():
    e = np.linalg.norm(v - g, axis=1) / np.linalg.norm(g, axis=1)
    print(f"{k:<28} rel vs generic per step: " + " ".join(f"{x:.1e}" for x in e), "argmax", v.argmax(1), g.argmax(1), flush=True)
