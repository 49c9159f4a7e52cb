"""DIAGNOSTIC (session 9): the experts pair kernel launched by CuPy vs by cuLaunchKernelEx."""
import numpy as np, cupy as cp
from strata.kernels.cuda import launch as L, mmvq as gpu
from strata.kernels.ggml_types import type_by_name
from strata.kernels.random_blocks import random_blocks
rng = np.random.default_rng(1)
t1, t2 = type_by_name("IQ3_S"), type_by_name("IQ3_XXS")
E, R, K, n, used = 8, 640, 2048, 3, 4
w1 = cp.asarray(np.stack([random_blocks(t1.id, R, K, rng) for _ in range(E)]))
w2 = cp.asarray(np.stack([random_blocks(t2.id, R, K, rng) for _ in range(E)]))
ids = cp.asarray(rng.integers(0, E, (n, used)).astype(np.int32))
q8 = gpu.quantize_q8_1(cp.asarray(rng.standard_normal((n, K)).astype(np.float32)))
a1, a2 = gpu.mmvq_experts_pair(t1.id, w1, t2.id, w2, ids, q8)
r1, r2 = gpu.mmvq_experts(t1.id, w1, ids, cp.zeros((n, K), cp.float32), q8=q8), gpu.mmvq_experts(t2.id, w2, ids, cp.zeros((n, K), cp.float32), q8=q8)
print("eager pair == two launches:", bool(cp.array_equal(a1, r1)), bool(cp.array_equal(a2, r2)))
L._capturing = lambda s: True
b1, b2 = gpu.mmvq_experts_pair(t1.id, w1, t2.id, w2, ids, q8)
cp.cuda.Device().synchronize()
print("ctypes pair == eager:", bool(cp.array_equal(a1, b1)), bool(cp.array_equal(a2, b2)),
      "nan:", int(cp.isnan(b1).sum()), int(cp.isnan(b2).sum()))
c1 = gpu.mmvq_experts(t1.id, w1, ids, cp.zeros((n, K), cp.float32), q8=q8)
print("ctypes ids == eager:", bool(cp.array_equal(c1, r1)))
