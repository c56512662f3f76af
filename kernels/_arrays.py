"""Array adaptation: numpy arrays, torch tensors (CPU or CUDA) and cupy arrays.

torch and cupy are never imported here; an object is recognised by its type's module
and the already-imported library is taken from ``sys.modules``.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

_FLOAT_NAMES = {"float16", "bfloat16", "float32", "float64"}


def _torch() -> Any:
    """The torch module; only called for torch tensors, so it is already imported."""
    return sys.modules["torch"]


def kind_of(obj: Any) -> str:
    """'numpy', 'torch' or 'cupy'; ``TypeError`` for anything else."""
    mod = type(obj).__module__
    if isinstance(obj, np.ndarray):
        return "numpy"
    if mod.startswith("torch") and hasattr(obj, "data_ptr"):
        return "torch"
    if mod.startswith("cupy") and hasattr(obj, "data"):
        return "cupy"
    raise TypeError(f"expected a numpy array, torch tensor or cupy array, got "
                    f"{type(obj).__module__}.{type(obj).__name__}")


def is_gpu(obj: Any, kind: str) -> bool:
    return kind == "cupy" or (kind == "torch" and obj.device.type != "cpu")


def dtype_name(obj: Any, kind: str) -> str:
    return str(obj.dtype).removeprefix("torch.")


def check_float(obj: Any, kind: str, what: str) -> None:
    if dtype_name(obj, kind) not in _FLOAT_NAMES:
        raise TypeError(f"{what} must be float16, bfloat16 (torch), float32 or float64, got "
                        f"{dtype_name(obj, kind)}")


def check_writable(obj: Any, kind: str, what: str, dtype: str, n: int) -> None:
    """For buffers written in place: ``dtype``, C-contiguous, ``n`` elements."""
    if dtype_name(obj, kind) != dtype:
        raise TypeError(f"{what} must be {dtype}, got {dtype_name(obj, kind)}")
    contiguous = obj.is_contiguous() if kind == "torch" else obj.flags.c_contiguous
    if not contiguous:
        raise ValueError(f"{what} must be C-contiguous (it is written in place)")
    if numel(obj, kind) != n:
        raise ValueError(f"{what} has {numel(obj, kind)} elements, {n} are needed")


def same_place(a: Any, b: Any, what: str) -> None:
    """``a`` and ``b`` are the same array kind on the same device, or ``TypeError``."""
    ka, kb = kind_of(a), kind_of(b)
    if ka != kb or device_of(a, ka) != device_of(b, kb):
        raise TypeError(f"{what} must be a {ka} array on {device_of(a, ka)}, got {kb} on "
                        f"{device_of(b, kb)}")


def device_of(obj: Any, kind: str) -> str:
    if kind == "torch":
        return str(obj.device)
    if kind == "cupy":
        return f"cuda:{obj.device.id}"
    return "cpu"


def device_index(obj: Any, kind: str) -> int:
    """CUDA device ordinal of a GPU array."""
    if kind == "torch":
        return obj.device.index if obj.device.index is not None else 0
    return obj.device.id


def numel(obj: Any, kind: str) -> int:
    return int(obj.numel()) if kind == "torch" else int(obj.size)


def host_float32(obj: Any, kind: str) -> np.ndarray:
    """Flat C-contiguous float32 numpy copy of ``obj``, or a view when none is needed."""
    if kind == "numpy":
        # float64 beyond the float32 range becomes inf, which the kernels then report
        with np.errstate(over="ignore"):
            return np.ascontiguousarray(obj, dtype=np.float32).reshape(-1)
    if kind == "torch":
        t = obj.detach().reshape(-1)
        if t.dtype != _torch().float32:
            t = t.float()
        return t.contiguous().cpu().numpy()
    return sys.modules["cupy"].asnumpy(obj.reshape(-1)).astype(np.float32, copy=False)


def host_uint8(obj: Any, kind: str, stop: int | None = None) -> np.ndarray:
    """Flat uint8 numpy view or copy of ``obj[:stop]``."""
    if dtype_name(obj, kind) != "uint8":
        raise TypeError(f"compressed buffer must be uint8, got {dtype_name(obj, kind)}")
    flat = obj.reshape(-1)[:stop]
    if kind == "numpy":
        return np.ascontiguousarray(flat)
    if kind == "torch":
        return flat.detach().contiguous().cpu().numpy()
    return sys.modules["cupy"].asnumpy(flat)


def host_inplace(obj: Any, kind: str) -> np.ndarray | None:
    """Flat numpy view sharing the contiguous ``obj``'s memory, or None if ``obj`` is
    on a GPU."""
    if kind == "numpy":
        return obj.reshape(-1)
    if kind == "torch" and obj.device.type == "cpu":
        return obj.detach().reshape(-1).numpy()
    return None


def gpu_flat(obj: Any, kind: str, float32: bool) -> Any:
    """Flat contiguous GPU array of ``obj`` in its own library (float32 if asked)."""
    if kind == "torch":
        t = obj.detach().reshape(-1)
        return (t.float() if float32 else t).contiguous()
    cp = sys.modules["cupy"]
    flat = cp.ascontiguousarray(obj.reshape(-1))
    return flat.astype(cp.float32, copy=False) if float32 else flat


def gpu_empty(like: Any, kind: str, n: int, dtype: str) -> Any:
    """Uninitialised (n,) array of ``dtype`` ('uint8' or 'float32') on ``like``'s GPU."""
    if kind == "torch":
        return _torch().empty(n, dtype=getattr(_torch(), dtype), device=like.device)
    cp = sys.modules["cupy"]
    with cp.cuda.Device(like.device.id):
        return cp.empty(n, dtype=dtype)


def like_host(arr: np.ndarray, like: Any, kind: str) -> Any:
    """``arr`` as an array of ``like``'s kind on ``like``'s device (shares memory on host)."""
    if kind == "numpy":
        return arr
    if kind == "torch":
        t = _torch().from_numpy(arr)
        return t if like.device.type == "cpu" else t.to(like.device)
    cp = sys.modules["cupy"]
    with cp.cuda.Device(like.device.id):
        return cp.asarray(arr)


def copy_from_host(dst: Any, kind: str, src: np.ndarray) -> None:
    """``dst[...] = src`` for a contiguous ``dst`` of any kind (``src`` flat)."""
    if kind == "numpy":
        dst.reshape(-1)[:] = src
    elif kind == "torch":
        dst.detach().view(-1).copy_(_torch().from_numpy(src))
    else:
        dst.reshape(-1).set(src)
