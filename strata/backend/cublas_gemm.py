"""cublasGemmEx on a cuBLAS handle of Strata's own, called through ctypes.

Why not CuPy's wrapper: cupy.cuda.cublas refuses to run while a stream is being captured
(its setStream raises), so a window whose long-prompt rows take the GEMM path could never be
a CUDA graph. cuBLAS itself can be captured once it needs no allocation: this handle gets a
workspace of its own (cublasSetWorkspace, after every cublasSetStream, which resets it), so a
GEMM allocates nothing inside a capture. Every prompt GEMM goes through this handle, captured
or not: cuBLAS chooses its kernel by shape and by the workspace it has, and a row's bits must
not depend on whether its window was replayed.

The library is the one CuPy already loaded (libcublas.so.<CUDA major> on Linux, cublas64_<major>.dll
on Windows); where it cannot be found, load() returns None and the backend keeps CuPy's wrapper
(such windows then stay eager).
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

WORKSPACE_BYTES = 32 << 20  # cuBLAS's own default on Hopper


def _library(cp) -> Any:
    cp.cuda.device.get_cublas_handle()  # makes CuPy load its cuBLAS first: the names below find it
    major = cp.cuda.runtime.runtimeGetVersion() // 1000
    names = [f"cublas64_{major}.dll"] if sys.platform == "win32" else [f"libcublas.so.{major}", "libcublas.so"]
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class CublasGemm:
    """gemm_ex(...) = cublasGemmEx on the current CuPy stream, host pointer mode."""

    def __init__(self, cp, lib: Any, workspace_bytes: int = WORKSPACE_BYTES):
        self.cp, self.lib = cp, lib
        vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasDestroy_v2.argtypes = [vp]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, sz]
        lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        for f in (lib.cublasCreate_v2, lib.cublasDestroy_v2, lib.cublasSetStream_v2, lib.cublasSetWorkspace_v2,
                  lib.cublasGemmEx):
            f.restype = ctypes.c_int
        self.handle = vp()
        self._check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self.workspace = cp.empty(int(workspace_bytes), dtype=cp.uint8)
        self._stream: int | None = None

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"cuBLAS: {what} returned status {status}")

    def _bind(self) -> None:
        """The handle on the current stream, with its workspace (setStream resets it)."""
        stream = int(self.cp.cuda.get_current_stream().ptr)
        if stream != self._stream:
            self._check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream)), "cublasSetStream")
            self._check(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                                                       self.workspace.nbytes), "cublasSetWorkspace")
            self._stream = stream

    def gemm_ex(self, transa: int, transb: int, m: int, n: int, k: int, alpha: int, a: int, atype: int, lda: int,
                b: int, btype: int, ldb: int, beta: int, c: int, ctype: int, ldc: int, compute: int, algo: int) -> None:
        self._bind()
        vp = ctypes.c_void_p
        self._check(self.lib.cublasGemmEx(self.handle, transa, transb, m, n, k, vp(alpha), vp(a), atype, lda,
                                          vp(b), btype, ldb, vp(beta), vp(c), ctype, ldc, compute, algo),
                    "cublasGemmEx")

    def __del__(self):
        handle = getattr(self, "handle", None)
        if handle is not None and handle.value:
            try:
                self.lib.cublasDestroy_v2(handle)
            except Exception:  # interpreter shutdown: the library may be gone
                pass


def load(cp) -> CublasGemm | None:
    """A CublasGemm, or None where the cuBLAS library cannot be reached through ctypes."""
    try:
        lib = _library(cp)
        return CublasGemm(cp, lib) if lib is not None else None
    except (OSError, AttributeError, RuntimeError):
        return None
