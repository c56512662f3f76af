"""broadcast: rank ``src``'s buffer is copied, in place, into every rank's buffer."""
from __future__ import annotations

from typing import Any

from ..base import accounting
from ..base.buffers import adapt
from . import node_shm
from ._base import after, call_blocking, resolve
from .work import Work


def broadcast(tensor: Any, src: int = 0, group: Any = None, async_op: bool = False) -> Any:
    """Copy ``tensor`` of rank ``src`` (a rank of ``group``) into ``tensor`` on every rank.

    Every rank passes a buffer of the same shape and dtype; on ``src`` it is only read.
    Returns ``tensor`` (or a :class:`Work`).
    """
    comm = resolve(group, "broadcast")
    rank = comm.rank
    src = comm.check_rank(src, "src", "broadcast")
    is_root = rank == src
    buf = adapt(tensor, "tensor", "broadcast", rank, write=not is_root, read=is_root)
    comm.seq += 1
    if comm.checking:
        comm.verify("broadcast", {"shape": buf.shape, "dtype": buf.dt.name, "src": src})
    if not async_op and node_shm.use(comm, buf, "broadcast"):  # one node: shared memory
        return node_shm.broadcast(comm, buf, src, tensor)
    if async_op:
        accounting.record("broadcast", buf.nbytes, comm.size)
        request = comm.mpi.Ibcast(buf.msg(), src)
        return Work(comm, "broadcast", buf, after(request, buf, result=tensor))
    call_blocking(comm, "broadcast", buf, buf.nbytes, comm.mpi.Bcast, (buf.msg(), src))
    buf.finish()
    return tensor

