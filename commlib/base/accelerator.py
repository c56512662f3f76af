"""The one place that knows about GPU libraries.

cupy, numba.cuda and torch.cuda are imported lazily, on first use, so the CPU install
never needs them; a missing library produces an error that says how to install it.
Whether the MPI library is CUDA-aware is decided once, here, and the reason is kept so
``commlib.tools.info`` can report how it was decided.
"""
from __future__ import annotations

import ctypes
import sys
from functools import cache
from types import ModuleType
from typing import Any

CUDA_HINT = "install the GPU extra: pip install 'commlib[cuda]' (cupy and numba-cuda)"


def kind_of(obj: Any) -> str | None:
    """'numpy', 'torch', 'cupy' or None, without importing torch or cupy."""
    mod = type(obj).__module__
    if mod == "numpy":
        return "numpy"
    if mod.startswith("torch"):
        return "torch"
    if mod.startswith("cupy"):
        return "cupy"
    return None


def is_device(obj: Any, kind: str) -> bool:
    """True for buffers in GPU memory (torch CUDA tensors and cupy arrays)."""
    if kind == "cupy":
        return True
    if kind == "torch":
        return obj.device.type != "cpu"
    return False


@cache
def optional(name: str) -> ModuleType | None:
    """Import an optional module, ``None`` if it is not installed or fails to import."""
    try:
        return __import__(name, fromlist=["_"])
    except Exception:
        return None


def cupy() -> ModuleType:
    mod = optional("cupy")
    if mod is None:
        raise ImportError(f"cupy is not importable; {CUDA_HINT}")
    return mod


def cuda_usable() -> dict[str, bool]:
    """Which GPU paths work on this machine (each probe is cheap and cached)."""
    out = {}
    torch = sys.modules.get("torch") or optional("torch")
    out["torch"] = torch is not None
    out["torch.cuda"] = bool(torch is not None and torch.cuda.is_available())
    cp = optional("cupy")
    try:
        out["cupy"] = bool(cp is not None and cp.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        out["cupy"] = False
    out["numba"] = optional("numba") is not None
    nc = optional("numba.cuda")
    try:
        out["numba.cuda"] = bool(nc is not None and nc.is_available())
    except Exception:
        out["numba.cuda"] = False
    return out


def synchronize(obj: Any, kind: str) -> None:
    """Wait for the work queued on ``obj``'s current stream, before MPI reads its memory."""
    if kind == "torch":
        import torch
        torch.cuda.current_stream(obj.device).synchronize()
    elif kind == "cupy":
        cupy().cuda.get_current_stream().synchronize()


def _loaded_libmpi() -> str | None:
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                path = line.rsplit(None, 1)[-1]
                if "/libmpi" in path and ".so" in path:
                    return path
    except OSError:
        pass
    return None


@cache
def _query_cuda_aware() -> tuple[bool, str]:
    from mpi4py import MPI  # noqa: F401  (loads libmpi)
    path = _loaded_libmpi()
    if path is None:
        return False, "libmpi not found among the loaded libraries; assuming not CUDA-aware"
    try:
        lib = ctypes.CDLL(path)
        query = lib.MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False, f"{path} has no MPIX_Query_cuda_support; assuming not CUDA-aware"
    query.restype = ctypes.c_int
    aware = bool(query())
    return aware, f"MPIX_Query_cuda_support() of {path} returned {int(aware)}"


def cuda_aware(setting: str = "auto") -> tuple[bool, str]:
    """Whether GPU buffers may go straight to MPI, and how that was decided.

    ``setting`` is the ``cuda_aware`` option: "1"/"0" force it, "auto" asks the library.
    """
    if setting == "1":
        return True, "forced by COMMLIB_CUDA_AWARE=1"
    if setting == "0":
        return False, "forced by COMMLIB_CUDA_AWARE=0"
    return _query_cuda_aware()
