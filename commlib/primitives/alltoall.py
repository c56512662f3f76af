"""alltoall: block ``j`` of rank ``i``'s buffer becomes block ``i`` of rank ``j``'s result
(``alltoall_v``: blocks of any number of rows)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..base import accounting
from ..base.buffers import adapt, output
from ..base.errors import where
from ._base import blocking, out_of_place, resolve


def alltoall(tensor: Any, group: Any = None, async_op: bool = False, out: Any = None) -> Any:
    """Exchange blocks between all pairs of ranks.

    ``tensor``'s leading dimension must be divisible by the group size ``n``; it is cut into
    ``n`` equal blocks along that dimension and block ``j`` goes to rank ``j``. Every rank
    passes the same shape and dtype. Returns a new array/tensor of the same shape whose
    block ``i`` came from rank ``i`` (or a :class:`Work`). The input is only read.
    ``out``: an optional result buffer to fill instead of allocating one (same kind, device
    and dtype as the input, the result's number of elements); it is what is returned.
    """
    comm = resolve(group, "alltoall")
    rank = comm.rank
    buf = adapt(tensor, "tensor", "alltoall", rank)
    n = comm.size
    if len(buf.shape) == 0 or buf.shape[0] % n:
        raise ValueError(f"{where('alltoall', rank)}: argument 'tensor' must have a leading "
                         f"dimension divisible by the group size {n}, got shape "
                         f"{tuple(buf.shape)}")
    comm.seq += 1
    if comm.checking:
        comm.verify("alltoall", {"shape": buf.shape, "dtype": buf.dt.name})
    out = output(buf, buf.shape, "alltoall", rank, out)
    accounting.record("alltoall", buf.nbytes, n)
    per_rank = buf.count // n
    send = [buf.mem, per_rank, buf.dt.mpi]
    recv = [out.mem, per_rank, buf.dt.mpi]
    return out_of_place(comm, "alltoall", buf, out, async_op, comm.mpi.Ialltoall, comm.mpi.Alltoall, send,
                        recv)


def alltoall_v(tensor: Any, send_splits: Sequence[int], recv_splits: Sequence[int] | None = None,
               group: Any = None, async_op: bool = False, out: Any = None) -> Any:
    """Exchange blocks of different sizes between all pairs of ranks.

    ``tensor`` is cut along its leading dimension into ``group_size`` consecutive blocks of
    ``send_splits[j]`` rows (``sum(send_splits) == tensor.shape[0]``); block ``j`` goes to
    rank ``j``. ``recv_splits[i]`` is the number of rows rank ``i`` sends here; ``None``
    learns them from the other ranks (one small blocking alltoall of the counts first).
    All ranks pass the same dtype and the same trailing dimensions. Returns a new
    array/tensor of shape ``(sum(recv_splits), *tensor.shape[1:])`` whose block ``i`` came
    from rank ``i`` (or a :class:`Work`). The input is only read. ``out``: an optional
    result buffer to fill instead (same kind, device and dtype as the input, the result's
    number of elements).
    """
    comm = resolve(group, "alltoall_v")
    rank, n = comm.rank, comm.size
    buf = adapt(tensor, "tensor", "alltoall_v", rank)
    if len(buf.shape) == 0:
        raise ValueError(f"{where('alltoall_v', rank)}: argument 'tensor' must have at least "
                         f"one dimension, got a scalar")
    send_splits = _splits(send_splits, "send_splits", n, rank)
    if sum(send_splits) != buf.shape[0]:
        raise ValueError(f"{where('alltoall_v', rank)}: argument 'send_splits'={send_splits} "
                         f"must add up to the leading dimension of 'tensor', "
                         f"{tuple(buf.shape)}")
    comm.seq += 1
    if comm.checking:
        comm.verify("alltoall_v", {"trailing": buf.shape[1:], "dtype": buf.dt.name})
    if recv_splits is None:
        counts = np.array(send_splits, dtype=np.int64)
        learned = np.empty(n, dtype=np.int64)
        blocking(comm, "alltoall_v", buf, comm.mpi.Alltoall, counts, learned)
        recv_splits = learned.tolist()
    recv_splits = _splits(recv_splits, "recv_splits", n, rank)
    out = output(buf, (sum(recv_splits),) + buf.shape[1:], "alltoall_v", rank, out)
    accounting.record("alltoall_v", buf.nbytes, n)
    row = math.prod(buf.shape[1:])
    send = [buf.mem, _counts_displs(send_splits, row), buf.dt.mpi]
    recv = [out.mem, _counts_displs(recv_splits, row), buf.dt.mpi]
    return out_of_place(comm, "alltoall_v", buf, out, async_op, comm.mpi.Ialltoallv, comm.mpi.Alltoallv, send,
                        recv)


def _splits(splits: Any, name: str, n: int, rank: int) -> list[int]:
    try:
        values = [int(s) for s in splits]
    except (TypeError, ValueError):
        raise TypeError(f"{where('alltoall_v', rank)}: argument {name!r} must be a sequence of "
                        f"{n} ints, got {splits!r}") from None
    if len(values) != n or any(v < 0 for v in values):
        raise ValueError(f"{where('alltoall_v', rank)}: argument {name!r} must hold one "
                         f"non-negative row count per rank ({n}), got {values}")
    return values


def _counts_displs(splits: list[int], row: int) -> tuple[list[int], list[int]]:
    counts = [s * row for s in splits]
    displs = [0] * len(counts)
    for i in range(1, len(counts)):
        displs[i] = displs[i - 1] + counts[i - 1]
    return counts, displs
