"""Which trainer runs and on what: PyTorch autograd (`torch`, the optional `train` extra) or
xp_net.py's hand-written backward on numpy or CuPy arrays (`xp`: no PyTorch needed).

Both libraries are optional, so each is imported inside the function that asks for it, and a
missing one is one line saying what to install.
"""

from __future__ import annotations

from strata.errors import StrataError

ENGINES = ("auto", "torch", "xp")


def torch_module():
    """PyTorch, or a StrataError that says how to get it (or train without it)."""
    try:
        import torch
    except ImportError:
        raise StrataError("strata mtp train needs PyTorch for --trainer torch: pip install 'strata[train]' "
                          "(torch is not installed; --trainer xp trains without it)") from None
    return torch


def has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_engine(engine: str) -> str:
    """torch or xp: `auto` is torch when PyTorch is importable, else xp."""
    if engine not in ENGINES:
        raise StrataError(f"--trainer {engine}: expected one of {', '.join(ENGINES)}")
    if engine == "auto":
        return "torch" if has_torch() else "xp"
    return engine


def cupy_module():
    """CuPy with a CUDA device, for the xp trainer on --device cuda."""
    try:
        import cupy
    except ImportError:
        raise StrataError("--device cuda: the xp trainer needs CuPy (pip install 'strata[gpu]'); cupy is not "
                          "installed") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device
        raise StrataError(f"--device cuda: CuPy sees no CUDA device ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if n < 1:
        raise StrataError("--device cuda: CuPy sees no CUDA device")
    return cupy


def target_device(device: str, engine: str) -> str:
    """Strata backend for the target: cuda with --device cuda (the torch trainer without CuPy: cpu)."""
    if device != "cuda":
        return "cpu"
    if engine == "xp" or has_cupy():
        return "cuda"
    return "cpu"
