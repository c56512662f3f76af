"""The shared-memory tier's reductions: numpy ufuncs combining every rank's piece in rank
order (bool ops as logical ones, bfloat16/float16 widened to float32 and rounded once), as
:mod:`commlib.primitives.node_shm` describes."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..base.dtypes import DType, f32_to_bf16
from ..base.reduce_ops import ReduceOp

_LOGICAL = {ReduceOp.SUM: np.logical_or, ReduceOp.MAX: np.logical_or,
            ReduceOp.BOR: np.logical_or, ReduceOp.MIN: np.logical_and,
            ReduceOp.PRODUCT: np.logical_and, ReduceOp.BAND: np.logical_and,
            ReduceOp.BXOR: np.logical_xor}
_UFUNC = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PRODUCT: np.multiply,
          ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum, ReduceOp.BAND: np.bitwise_and,
          ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}

Combine = Callable[[np.ndarray, list], None]


_combiners: dict[tuple[ReduceOp, str], Combine] = {}


def combiner(op: ReduceOp, dt: DType) -> Combine:
    """``combine(dst, srcs)``: ``dst[...] = srcs[0] op srcs[1] op ... op srcs[-1]``, left
    to right (rank order); ``dst`` may be ``srcs[0]`` itself, no other source. ``op`` must
    be valid for ``dt`` (``commlib.base.reduce_ops.mpi_op`` checked it)."""
    key = (op, dt.name)
    found = _combiners.get(key)
    if found is None:
        found = _combiners[key] = _make_combiner(op, dt)
    return found


def _make_combiner(op: ReduceOp, dt: DType) -> Combine:
    ufunc = _LOGICAL[op] if dt.kind == "b" else _UFUNC[op]
    if dt.name in ("bfloat16", "float16"):
        return _half_combiner(ufunc, dt.name == "bfloat16")

    def combine(dst: np.ndarray, srcs: list) -> None:
        if len(srcs) == 1:
            if dst is not srcs[0]:
                np.copyto(dst, srcs[0])
            return
        ufunc(srcs[0], srcs[1], out=dst)
        for src in srcs[2:]:
            ufunc(dst, src, out=dst)

    return combine


def _half_combiner(ufunc: Any, bf16: bool) -> Combine:
    def widen(words: np.ndarray, out: np.ndarray) -> np.ndarray:
        if bf16:
            wide = out.view(np.uint32)
            np.copyto(wide, words)
            np.left_shift(wide, 16, out=wide)
        else:
            np.copyto(out, words.view(np.float16))
        return out

    def combine(dst: np.ndarray, srcs: list) -> None:
        acc = widen(srcs[0], np.empty(dst.size, np.float32))
        tmp = np.empty(dst.size, np.float32)
        for src in srcs[1:]:
            ufunc(acc, widen(src, tmp), out=acc)
        if bf16:
            dst[...] = f32_to_bf16(acc)
        else:
            dst.view(np.float16)[...] = acc

    return combine
