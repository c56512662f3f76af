"""gather: every rank's buffer lands, stacked, on one rank."""
from __future__ import annotations

from typing import Any

from ..base import accounting
from ..base.buffers import adapt, output
from ._base import after, blocking, resolve
from .work import Work


def gather(tensor: Any, dst: int = 0, group: Any = None, async_op: bool = False,
           out: Any = None) -> Any:
    """Gather ``tensor`` from every rank of ``group`` onto rank ``dst`` (a rank of ``group``).

    Every rank passes the same shape and dtype; the input is only read. On ``dst`` returns a
    new array/tensor of the input's kind, dtype and device with shape
    ``(group_size, *tensor.shape)`` whose row ``r`` is rank ``r``'s buffer; on the other
    ranks returns ``None`` (with ``async_op=True``: a :class:`Work` whose ``wait()`` returns
    that). ``out``: on ``dst``, an optional result buffer to fill instead (same kind, device
    and dtype as the input, the result's number of elements); ignored elsewhere.
    """
    comm = resolve(group, "gather")
    rank = comm.rank
    dst = comm.check_rank(dst, "dst", "gather")
    buf = adapt(tensor, "tensor", "gather", rank)
    comm.seq += 1
    if comm.checking:
        comm.verify("gather", {"shape": buf.shape, "dtype": buf.dt.name, "dst": dst})
    accounting.record("gather", buf.nbytes, comm.size)
    res = None
    recv = None
    if rank == dst:
        res = output(buf, (comm.size,) + buf.shape, "gather", rank, out)
        recv = [res.mem, buf.count, buf.dt.mpi]
    bufs = (buf, res) if res is not None else (buf,)
    result = res.obj if res is not None else None
    if async_op:
        request = comm.mpi.Igather(buf.msg(), recv, dst)
        return Work(comm, "gather", buf, after(request, *bufs, result=result))
    blocking(comm, "gather", buf, comm.mpi.Gather, buf.msg(), recv, dst)
    for b in bufs:
        b.finish()
    return result
