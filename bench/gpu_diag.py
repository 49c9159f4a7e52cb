"""Diagnose CUDA vs CPU backend differences layer by layer (device helper script)."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from strata.backend.cpu import CpuBackend  # noqa: E402
from strata.backend.cuda import CudaBackend  # noqa: E402
from strata.kernels.ggml_types import type_by_id  # noqa: E402
from strata.pack.loader import open_pack  # noqa: E402

pack = open_pack(pack=sys.argv[1])
cpu, gpu = CpuBackend(), CudaBackend()
rng = np.random.default_rng(0)
for name in ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight",
             "blk.0.ffn_down.weight", "blk.0.attn_output.weight"]:
    src = pack.tensors[name]
    for nc in (1, 3, 9):
        x = rng.standard_normal((nc, src.shape[0])).astype(np.float32)
        a = cpu.linear(cpu.linear_weight([src]), x)
        b = gpu.to_host(gpu.linear(gpu.linear_weight([src]), gpu.asarray(x)))
        print(f"{name:28s} {type_by_id(src.ggml_type).name:7s} ncols {nc}: rel err {np.linalg.norm(a-b)/np.linalg.norm(a):.2e}")
e = pack.tensors["token_embd.weight"]
ids = np.array([1, 5, 900, 49000])
a = cpu.embed(cpu.embedding(e), ids)
b = gpu.to_host(gpu.embed(gpu.embedding(e), ids))
print("embed", type_by_id(e.ggml_type).name, np.abs(a - b).max())
x = rng.standard_normal((5, 576)).astype(np.float32)
w = rng.standard_normal(576).astype(np.float32)
print("rms", np.abs(cpu.rms_norm(x, w, 1e-5) - gpu.to_host(gpu.rms_norm(gpu.asarray(x), gpu.asarray(w), 1e-5))).max())
q = rng.standard_normal((5, 9, 64)).astype(np.float32)
pos = np.arange(3, 8)
r1 = cpu.rope(q, pos, base=1e5, dim=64, scale=1.0, neox=False)
r2 = gpu.to_host(gpu.rope(gpu.asarray(q), gpu.asarray(pos), base=1e5, dim=64, scale=1.0, neox=False))
print("rope", np.abs(r1 - r2).max())
k = rng.standard_normal((3, 8, 64)).astype(np.float32)
v = rng.standard_normal((3, 8, 64)).astype(np.float32)
a1 = cpu.attention(q, k, v, pos)
a2 = gpu.to_host(gpu.attention(gpu.asarray(q), gpu.asarray(k), gpu.asarray(v), gpu.asarray(pos)))
print("attention", np.abs(a1 - a2).max())
