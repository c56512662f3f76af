"""allgather and allgather_v: every rank receives every rank's buffer."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..base import accounting
from ..base.buffers import Buf, adapt, output
from ..base.errors import CommError, where
from . import node_shm
from ._base import after, blocking, out_of_place, resolve
from .work import Work


def allgather(tensor: Any, group: Any = None, async_op: bool = False, out: Any = None) -> Any:
    """Gather ``tensor`` from every rank of ``group`` onto every rank.

    Every rank passes the same shape and dtype. Returns a new array/tensor of the input's
    kind, dtype and device with shape ``(group_size, *tensor.shape)``; row ``r`` is rank
    ``r``'s buffer (or a :class:`Work` whose ``wait()`` returns it). The input is only read.
    ``out``: an optional result buffer to fill instead of allocating one (same kind, device
    and dtype as the input, the result's number of elements); it is what is returned.
    """
    comm = resolve(group, "allgather")
    rank = comm.rank
    buf = adapt(tensor, "tensor", "allgather", rank)
    comm.seq += 1
    if comm.checking:
        comm.verify("allgather", {"shape": buf.shape, "dtype": buf.dt.name})
    out = output(buf, (comm.size,) + buf.shape, "allgather", rank, out)
    if not async_op and node_shm.use(comm, buf, "allgather"):  # one node: shared memory
        return node_shm.allgather(comm, buf, out)
    accounting.record("allgather", buf.nbytes, comm.size)
    send = buf.msg()
    recv = [out.mem, buf.count, buf.dt.mpi]
    return out_of_place(comm, "allgather", buf, out, async_op, comm.mpi.Iallgather, comm.mpi.Allgather, send,
                        recv)


def allgather_v(tensor: Any, group: Any = None, async_op: bool = False) -> Any:
    """Gather buffers whose first dimension differs between ranks.

    All ranks must agree on the dtype and on every dimension but the first (this is always
    checked: the shapes travel first, in a small allgather). Returns a list of ``group_size``
    arrays/tensors of the input's kind; entry ``r`` has rank ``r``'s shape and contents (views
    into one new buffer). With ``async_op=True`` the shape exchange still blocks and the data
    exchange is returned as a :class:`Work`.
    """
    comm = resolve(group, "allgather_v")
    rank = comm.rank
    buf = adapt(tensor, "tensor", "allgather_v", rank)
    if len(buf.shape) == 0:
        raise ValueError(f"{where('allgather_v', rank)}: argument 'tensor' must have at least "
                         f"one dimension, got a scalar")
    comm.seq += 1
    mine = (buf.shape, buf.dt.name)
    meta = blocking(comm, "allgather_v", buf, comm.mpi.allgather, mine)
    accounting.record("allgather", 8 * (len(buf.shape) + 1), comm.size)
    trailing = {(s[1:], d) for s, d in meta}
    if len(trailing) != 1:
        detail = "; ".join(f"rank {r}: shape {tuple(s)} {d}" for r, (s, d) in enumerate(meta))
        raise CommError(f"{where('allgather_v', rank)}: ranks must agree on the dtype and on "
                        f"all dimensions but the first, got {detail}")
    firsts = [s[0] for s, _ in meta]
    per_row = int(np.prod(buf.shape[1:], dtype=np.int64))
    counts = [f * per_row for f in firsts]
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
    out = output(buf, (sum(firsts),) + buf.shape[1:], "allgather_v", rank)
    accounting.record("allgather_v", buf.nbytes, comm.size)
    recv = [out.mem, (counts, displs), buf.dt.mpi]
    if async_op:
        request = comm.mpi.Iallgatherv(buf.msg(), recv)
        return Work(comm, "allgather_v", buf,
                    after(request, buf, out, result=lambda: _split(out, firsts)))
    blocking(comm, "allgather_v", buf, comm.mpi.Allgatherv, buf.msg(), recv)
    buf.finish()
    out.finish()
    return _split(out, firsts)


def _split(out: Buf, firsts: list[int]) -> list[Any]:
    pieces, start = [], 0
    for f in firsts:
        pieces.append(out.obj[start:start + f])
        start += f
    return pieces
