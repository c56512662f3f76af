"""What the backend translates: torch's reduce ops to commlib's, option objects, and the
errors it raises for what it does not do."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..errors import CommError
from ..reduce_ops import ReduceOp

_T = dist.ReduceOp.RedOpType
_OPS = {_T.SUM: ReduceOp.SUM, _T.AVG: ReduceOp.AVG, _T.PRODUCT: ReduceOp.PRODUCT,
        _T.MIN: ReduceOp.MIN, _T.MAX: ReduceOp.MAX, _T.BAND: ReduceOp.BAND,
        _T.BOR: ReduceOp.BOR, _T.BXOR: ReduceOp.BXOR}


class UnsupportedOperation(CommError, NotImplementedError):
    """An operation (or reduce op) of torch.distributed the commlib backend does not
    provide; the message names it."""


def where(op: str, rank: int) -> str:
    return f"torch.distributed {op} over the commlib backend (rank {rank})"


def unsupported(op: str, rank: int, detail: str = "") -> UnsupportedOperation:
    return UnsupportedOperation(f"{where(op, rank)}: {op} is not supported by the commlib "
                                f"backend{'; ' + detail if detail else ''}")


def reduce_op(opts: Any, op: str, rank: int) -> ReduceOp:
    """commlib's op for ``opts.reduceOp`` (a ``torch.distributed.ReduceOp``)."""
    try:
        return _OPS[opts.reduceOp.op]
    except (AttributeError, KeyError):
        pass
    red = getattr(opts, "reduceOp", opts)
    kind = getattr(red, "op", red)
    found = _OPS.get(kind)
    if found is None:
        name = getattr(kind, "name", str(kind))
        raise unsupported(f"{op} with ReduceOp.{name}", rank,
                          "supported: " + ", ".join(f"ReduceOp.{k.name}" for k in _OPS))
    return found


def check_count(tensor: Any, numel: int, what: str, op: str, rank: int) -> None:
    if tensor.numel() != numel:
        raise ValueError(f"{where(op, rank)}: {what} must have {numel} elements, got shape "
                         f"{tuple(tensor.shape)}")


def check_list(tensors: Any, n: int, what: str, op: str, rank: int) -> list:
    tensors = list(tensors)
    if len(tensors) != n:
        raise ValueError(f"{where(op, rank)}: {what} must hold one tensor per rank of the "
                         f"group ({n}), got {len(tensors)}")
    return tensors
