"""Zero-copy numpy views of contiguous CPU torch tensors, made once per memory signature.

``tensor.numpy()`` costs more than a small MPI call (about 0.6 us), and commlib hands MPI a
numpy view of every CPU tensor it is given. :func:`view` keeps the views it made, one per
address (``data_ptr``), with the torch dtype and shape they were made for: a tensor whose
memory starts at that address, with that dtype and shape, gets the same view again. A
cached view does not own the tensor's memory (it is made from the address alone, so the
cache keeps no tensor alive); it is only handed out for a tensor that has exactly that
address, dtype and shape at the time of the call, which therefore owns that memory for as
long as the caller holds it. A tensor whose memory changed (``set_``, ``resize_``,
``.data =`` a tensor of another dtype) misses and gets a new view. Only plain
``torch.Tensor`` objects without the conjugate or negative bit are served from the cache;
others (subclasses, lazily conjugated or negated views) get ``tensor.numpy()`` every
time, with its checks and errors. The cache is emptied when it holds :data:`MAX_VIEWS` views.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .dtypes import DType

#: Views kept at most (each a few hundred bytes); the cache is emptied when full.
MAX_VIEWS = 512

#: data_ptr -> (torch dtype, shape, view): one entry per address, the last one made
_views: dict[int, tuple] = {}
_plain: Any = None  # torch.Tensor, once a tensor was seen (no torch import here)


def view(t: Any, dtype: Any, dt: DType) -> np.ndarray:
    """A numpy view of the contiguous CPU tensor ``t`` (``dtype``: ``t.dtype``; ``dt``:
    commlib's entry for it; bfloat16 as uint16 words)."""
    ptr = t.data_ptr()
    found = _views.get(ptr)
    if (found is not None and found[0] is dtype and t.__class__ is _plain
            and found[1] == t.shape and not t.is_neg()
            and (dt.kind != "c" or not t.is_conj())):
        return found[2]
    return _miss(t, ptr, dtype, dt)


def plain() -> Any:
    """``torch.Tensor`` once :func:`view` saw a tensor, else ``None`` (imports nothing)."""
    return _plain


def _miss(t: Any, ptr: int, dtype: Any, dt: DType) -> np.ndarray:
    global _plain
    if dt.name == "bfloat16":
        import torch
        owned = t.view(torch.int16).numpy().view(np.uint16)
    else:
        owned = t.numpy()  # checks what numpy() checks (conjugate bit, ...) and raises
    if _plain is None:
        import torch
        _plain = torch.Tensor
    if t.__class__ is _plain and owned.size and not t.is_neg() and not t.is_conj():
        if len(_views) >= MAX_VIEWS:
            _views.clear()
        _views[ptr] = (dtype, tuple(t.shape), _unowned(owned))
    return owned


class _Memory:
    """The address, shape and type of a view, for numpy's array interface (no owner)."""

    def __init__(self, a: np.ndarray) -> None:
        self.__array_interface__ = {"data": (a.ctypes.data, False), "shape": a.shape,
                                    "typestr": a.dtype.str, "version": 3}


def _unowned(a: np.ndarray) -> np.ndarray:
    return np.asarray(_Memory(a))


def clear() -> None:
    """Forget every view (tests)."""
    _views.clear()
