"""alltoall: block ``j`` of rank ``i``'s buffer becomes block ``i`` of rank ``j``'s result."""
from __future__ import annotations

from typing import Any

from .. import accounting
from ..buffers import adapt, output
from ..errors import where
from ._base import after, blocking, resolve
from .work import Work


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
    if async_op:
        request = comm.mpi.Ialltoall(send, recv)
        return Work(comm, "alltoall", buf, after(request, buf, out, result=out.obj))
    blocking(comm, "alltoall", buf, comm.mpi.Alltoall, send, recv)
    buf.finish()
    out.finish()
    return out.obj

