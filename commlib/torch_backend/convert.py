"""What the backend translates: torch's reduce ops to commlib's, option objects, and the
errors it raises for what it does not do; which buffers overlap."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..base.errors import CommError
from ..base.reduce_ops import ReduceOp

_T = dist.ReduceOp.RedOpType
_OPS = {_T.SUM: ReduceOp.SUM, _T.AVG: ReduceOp.AVG, _T.PRODUCT: ReduceOp.PRODUCT,
        _T.MIN: ReduceOp.MIN, _T.MAX: ReduceOp.MAX, _T.BAND: ReduceOp.BAND,
        _T.BOR: ReduceOp.BOR, _T.BXOR: ReduceOp.BXOR}
_BY_VALUE = {int(k): v for k, v in _OPS.items()}


def _hash_is_value() -> bool:
    try:
        return all(hash(dist.ReduceOp(k)) == int(k) for k in _OPS)
    except Exception:  # noqa: BLE001 - then the slower .op.value
        return False


_HASH_IS_VALUE = _hash_is_value()


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
        red = opts.reduceOp
        # ints hash fast, the pybind enum does not; hash(ReduceOp) is its op's value
        # wherever _HASH_IS_VALUE says so (checked at import), and reading .op costs more
        return _BY_VALUE[hash(red) if _HASH_IS_VALUE else red.op.value]
    except (AttributeError, KeyError, TypeError):
        pass
    red = getattr(opts, "reduceOp", opts)
    kind = getattr(red, "op", red)
    found = _OPS.get(kind)
    if found is None:
        name = getattr(kind, "name", str(kind))
        raise unsupported(f"{op} with ReduceOp.{name}", rank,
                          "supported: " + ", ".join(f"ReduceOp.{k.name}" for k in _OPS))
    return found


def integer_average(op: ReduceOp, tensor: Any, opname: str, rank: int) -> bool:
    """Whether ``op`` is ``ReduceOp.AVG`` on an integer tensor, which the backend runs as
    NCCL runs ``ncclAvg`` on integers (``FuncSumPostDiv``): the sum over the group, in the
    tensor's dtype (wrapping around on overflow, as MPI's and NCCL's integer sums do),
    then divided by the group size, truncating toward zero (the magnitude divided, the
    sign kept: ``-7 / 2 == -3``). Lightning's ``sync_dist=True`` sends exactly this for
    every backend not named gloo. ``bool`` tensors raise ``TypeError``, as torch's NCCL
    backend does."""
    if op is not ReduceOp.AVG:
        return False
    dtype = tensor.dtype
    if dtype == torch.bool:
        raise TypeError(f"{where(opname, rank)}: cannot use ReduceOp.AVG with boolean "
                        f"inputs")
    return not (dtype.is_floating_point or dtype.is_complex)


def divide_truncating(tensor: Any, n: int) -> None:
    """``tensor`` (integer) divided by ``n`` in place, rounding toward zero."""
    if n != 1:
        with torch.no_grad():
            tensor.detach().div_(n, rounding_mode="trunc")


def dense(tensors: Any, op: str, rank: int) -> None:
    """Refuse sparse (and other non-strided) tensors, naming them and ``op``."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.layout != torch.strided:
            raise unsupported(f"{op} of a {t.layout} tensor", rank,
                              "sparse tensors are supported by all_reduce (ReduceOp.SUM) "
                              "only, as by gloo")


def _extent(t: Any) -> tuple[int, int]:
    """The bytes ``[start, end)`` that ``t``'s elements span."""
    start = t.data_ptr()
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return start, start + span * t.element_size()


def overlaps(a: Any, b: Any) -> bool:
    """Whether tensors ``a`` and ``b`` may share memory (their byte spans intersect; a
    strided tensor interleaved with another counts as overlapping)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, a1 = _extent(a)
    b0, b1 = _extent(b)
    return a0 < b1 and b0 < a1


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


def flatten(tensors: list) -> torch.Tensor:
    """One contiguous 1-D tensor holding ``tensors`` one after the other."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, tensors: list) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.detach().copy_(flat[offset:offset + n].view_as(t))
            offset += n


def one(tensors: Any, op: str, rank: int) -> Any:
    if len(tensors) != 1:
        raise ValueError(f"{where(op, rank)}: the commlib backend takes one tensor per rank "
                         f"here, got {len(tensors)}")
    return tensors[0]


def as_list(tensors: Any) -> list:
    return tensors if tensors.__class__ is list else (
        [tensors] if isinstance(tensors, torch.Tensor) else list(tensors))
