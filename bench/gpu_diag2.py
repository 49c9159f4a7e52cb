"""Per-layer hidden states: CUDA vs CPU vs CPU with Q8_1-quantized activations (device helper)."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import strata.backend.cpu as cb  # noqa: E402
from strata.engine.core import EngineCore  # noqa: E402
from strata.engine.options import parse_engine_args  # noqa: E402
from strata.model import transformer as T  # noqa: E402

rec = {}
orig_block = T.BlockRunner.block


def block(self, bw, layer, x, spans, pos):
    out = orig_block(self, bw, layer, x, spans, pos)
    rec.setdefault(self.b.name + getattr(self.b, "tag", ""), []).append(self.b.to_host(out).copy())
    return out


T.BlockRunner.block = block


def q8(x):
    s = x.reshape(x.shape[0], -1, 32)
    d = np.abs(s).max(-1, keepdims=True) / 127
    d[d == 0] = 1
    return (np.round(s / d) * d).reshape(x.shape).astype(np.float32)


class Q8Cpu(cb.CpuBackend):
    tag = "q8"

    def linear(self, w, x):
        return np.matmul(q8(x), w.wt)


cores = {}
for dev in ("cpu", "cuda"):
    cores[dev] = EngineCore.load(parse_engine_args(["--pack", sys.argv[1], "--device", dev], serving=False), log=lambda s: None)
import strata.backend.select as sel  # noqa: E402
sel.make_backend = lambda device="auto", no_native=None: Q8Cpu()
import strata.engine.core as ec  # noqa: E402
ec.make_backend = sel.make_backend
cores["q8"] = EngineCore.load(parse_engine_args(["--pack", sys.argv[1], "--device", "cpu"], serving=False), log=lambda s: None)
ids = cores["cpu"].tokenizer.encode(cores["cpu"].chat.render([{"role": "user", "content": "What is the capital of France?"}]), add_special=True)
for name, core in cores.items():
    c = core.model.new_cache(4096, "f16")
    h = core.model.forward(np.asarray(ids), [T.Span(c, 0, len(ids))])
    rec.setdefault("logits_" + name, core.model.b.to_host(core.model.logits(h)))
for i in range(0, 30, 3):
    a, b, q = rec["cpu"][i], rec["cuda"][i], rec["cpuq8"][i]
    n = np.linalg.norm(a)
    print(f"layer {i:2d}: cuda vs cpu {np.linalg.norm(b - a) / n:.2e}   cpu-q8 vs cpu {np.linalg.norm(q - a) / n:.2e}   cuda vs cpu-q8 {np.linalg.norm(b - q) / n:.2e}")
for k in ("cuda", "q8"):
    a, b = rec["logits_cpu"], rec["logits_" + k]
    print(k, "logits rel", np.linalg.norm(a - b) / np.linalg.norm(a), "argmax last", a[-1].argmax(), b[-1].argmax())
