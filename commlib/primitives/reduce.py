"""reduce: the reduction of all ranks' buffers lands in place on ``dst``."""
from __future__ import annotations

from typing import Any

from mpi4py import MPI

from ..base import accounting
from ..base.buffers import Buf, adapt
from ..base.reduce_ops import ReduceOp, as_reduce_op, mpi_op
from ..core.communicator import Communicator
from ._base import call_blocking, finish_reduce, resolve
from .work import Work


def reduce(tensor: Any, dst: int = 0, op: ReduceOp = ReduceOp.SUM, group: Any = None,
           async_op: bool = False) -> Any:
    """Reduce ``tensor`` over ``group`` into ``tensor`` on rank ``dst`` (a rank of ``group``).

    On ``dst`` the buffer is overwritten with the result; on every other rank it is only
    read and left unchanged. Same shapes and dtypes on every rank. Returns ``tensor`` (or a
    :class:`Work`).
    """
    comm = resolve(group, "reduce")
    rank = comm.rank
    dst = comm.check_rank(dst, "dst", "reduce")
    is_root = rank == dst
    buf = adapt(tensor, "tensor", "reduce", rank, write=is_root)
    if op.__class__ is not ReduceOp:
        op = as_reduce_op(op, "reduce", rank)
    mop = mpi_op(op, buf.dt, "reduce", rank)
    comm.seq += 1
    if comm.checking:
        comm.verify("reduce", {"shape": buf.shape, "dtype": buf.dt.name, "op": op.name,
                               "dst": dst})
    send, recv = (MPI.IN_PLACE, buf.msg()) if is_root else (buf.msg(), None)
    if async_op:
        accounting.record("reduce", buf.nbytes, comm.size)
        return Work(comm, "reduce", buf, _async(comm, buf, op, mop, dst, send, recv, tensor))
    call_blocking(comm, "reduce", buf, buf.nbytes, comm.mpi.Reduce, (send, recv, mop, dst))
    _finish(buf, op, comm, is_root)
    return tensor


def _finish(buf: Buf, op: ReduceOp, comm: Communicator, is_root: bool) -> None:
    if is_root:
        finish_reduce(buf, op, comm.size)
    else:
        buf.finish()


def _async(comm: Communicator, buf: Buf, op: ReduceOp, mop: Any, dst: int, send: Any,
           recv: Any, tensor: Any) -> Any:
    yield comm.mpi.Ireduce(send, recv, mop, dst)
    _finish(buf, op, comm, comm.rank == dst)
    return tensor
