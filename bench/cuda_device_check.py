"""One device-machine call: the CUDA tests, then the MMVQ bandwidth table, in one process
(so NVRTC compiles each module once).

    PYTHONUNBUFFERED=1 python3 bench/cuda_device_check.py [bench_mmvq args...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    import cupy as cp
    import pytest

    from strata.kernels.cuda import mmvq as gpu

    print(f"cupy {cp.__version__}, CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}")
    t0 = time.perf_counter()
    gpu.compile_all(threads=16)
    print(f"compile_all: {time.perf_counter() - t0:.1f} s", flush=True)
    tests = sorted(str(p) for p in (ROOT / "tests").glob("test_cuda_*.py"))
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "-rf", *tests])
    print(f"pytest exit code {rc}", flush=True)
    import bench_mmvq

    bench_mmvq.main(sys.argv[1:])
    return int(rc)


if __name__ == "__main__":
    raise SystemExit(main())
