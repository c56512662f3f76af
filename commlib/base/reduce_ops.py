"""Reduction operators and their MPI implementations.

``AVG`` is a ``SUM`` on the wire followed by a division by the group size on the receiving
ranks; it is defined for floating-point and complex buffers only (an integer average would
silently truncate). For ``bool`` buffers ``SUM``/``MAX`` are logical OR and
``MIN``/``PRODUCT`` logical AND. The bitwise ``BAND``/``BOR``/``BXOR`` are defined for
integer and bool buffers only (on bool: logical AND, OR, XOR). ``bfloat16`` (and
``float16`` where MPI has no native half type) are reduced by user-defined operations
that combine each pair of operands in float32 and round the result back to 16 bits, so
every intermediate is representable and the result matches a float32 reduction rounded
per step.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from .dtypes import DType, bf16_to_f32, f32_to_bf16
from .errors import where


class ReduceOp(enum.Enum):
    """A reduction operator: the ``op`` of :func:`commlib.allreduce`, :func:`commlib.reduce`
    and :func:`commlib.reduce_scatter`, which also take its name in any case (the module
    docstring above says which dtypes each operator takes)::

        # run: mpiexec -n 2
        import numpy as np
        import commlib

        commlib.init()
        x = np.array([1.0, 2.0]) * (commlib.get_rank() + 1)     # [1, 2] and [2, 4]
        assert commlib.allreduce(x.copy(), op=commlib.ReduceOp.MAX).tolist() == [2.0, 4.0]
        assert commlib.allreduce(x.copy(), op="avg").tolist() == [1.5, 3.0]   # in place
    """

    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"


def as_reduce_op(op: Any, opname: str, rank: int) -> ReduceOp:
    """Accept a :class:`ReduceOp` or its name (any case); anything else is a ``ValueError``."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str) and op.upper() in ReduceOp.__members__:
        return ReduceOp[op.upper()]
    raise ValueError(f"{where(opname, rank)}: argument 'op' must be one of "
                     f"{', '.join('ReduceOp.' + m for m in ReduceOp.__members__)}, got {op!r}")


_NATIVE = {
    ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD,
    ReduceOp.BAND: MPI.BAND, ReduceOp.BOR: MPI.BOR, ReduceOp.BXOR: MPI.BXOR,
}
_LOGICAL = {ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR,
            ReduceOp.MIN: MPI.LAND, ReduceOp.PRODUCT: MPI.LAND,
            ReduceOp.BAND: MPI.LAND, ReduceOp.BOR: MPI.LOR, ReduceOp.BXOR: MPI.LXOR}
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
_NUMPY = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MIN: np.minimum,
          ReduceOp.MAX: np.maximum, ReduceOp.PRODUCT: np.multiply}
_user_ops: dict[tuple[str, ReduceOp], Any] = {}
_resolved: dict[tuple[str, str], Any] = {}  # (op.value, dtype name): str keys hash fast


def mpi_op(op: ReduceOp, dt: DType, opname: str, rank: int) -> Any:
    """The ``MPI.Op`` that implements ``op`` on elements of ``dt``; raises ``ValueError`` for
    combinations without a meaning (AVG on integers or bool, MIN/MAX on complex)."""
    key = (op._value_, dt.name)
    found = _resolved.get(key)
    if found is None:
        found = _resolved[key] = _resolve(op, dt, opname, rank)
    return found


def _resolve(op: ReduceOp, dt: DType, opname: str, rank: int) -> Any:
    kind = dt.kind
    if op is ReduceOp.AVG and kind not in "fc":
        raise ValueError(f"{where(opname, rank)}: ReduceOp.AVG needs a floating-point or complex "
                         f"buffer, got {dt.name}; use ReduceOp.SUM and divide")
    if op in _BITWISE and kind not in "iub":
        raise ValueError(f"{where(opname, rank)}: {op!r} needs an integer or bool buffer, got "
                         f"{dt.name}")
    if kind == "c" and op in (ReduceOp.MIN, ReduceOp.MAX):
        raise ValueError(f"{where(opname, rank)}: {op!r} is undefined for complex buffers "
                         f"({dt.name})")
    if kind == "b":
        return _LOGICAL[op]
    if dt.native_reduce:
        return _NATIVE[op]
    return _user_op(dt.name, op)


def _user_op(name: str, op: ReduceOp) -> Any:
    key = (name, op)
    if key not in _user_ops:
        _user_ops[key] = MPI.Op.Create(_half_combiner(name, _NUMPY[op]), commute=True)
    return _user_ops[key]


def _half_combiner(name: str, ufunc: Callable[[np.ndarray, np.ndarray], np.ndarray]
                   ) -> Callable[[Any, Any, Any], None]:
    if name == "bfloat16":
        widen, narrow = bf16_to_f32, f32_to_bf16
    else:
        def widen(words: np.ndarray) -> np.ndarray:
            return words.view(np.float16).astype(np.float32)

        def narrow(values: np.ndarray) -> np.ndarray:
            return values.astype(np.float16).view(np.uint16)

    def combine(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        a = np.frombuffer(inbuf, dtype=np.uint16)
        b = np.frombuffer(inoutbuf, dtype=np.uint16)
        b[...] = narrow(ufunc(widen(a), widen(b)))

    return combine

