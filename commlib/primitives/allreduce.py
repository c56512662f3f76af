"""allreduce: every rank ends with the reduction of all ranks' buffers, in place."""
from __future__ import annotations

from typing import Any

from mpi4py import MPI

from .. import accounting
from ..buffers import Buf, adapt
from ..communicator import Communicator
from ..reduce_ops import ReduceOp, as_reduce_op, mpi_op
from ._base import blocking, finish_reduce, resolve
from .work import Work

IN_PLACE = MPI.IN_PLACE


def allreduce(tensor: Any, op: ReduceOp = ReduceOp.SUM, group: Any = None,
              async_op: bool = False, hierarchical: bool | None = None) -> Any:
    """Reduce ``tensor`` over all ranks of ``group``, in place, on every rank.

    ``tensor``: numpy array, torch tensor (CPU or CUDA) or cupy array of any shape and of a
    dtype MPI carries (see :mod:`commlib.dtypes`); every rank passes the same shape and
    dtype. ``op``: a :class:`ReduceOp` (AVG = SUM / group size, floating point only).
    ``hierarchical``: reduce inside each node, allreduce among node leaders, broadcast inside
    each node (same result as the flat algorithm up to floating-point summation order);
    ``None`` takes the group's default. Returns ``tensor`` (or a :class:`Work` whose
    ``wait()`` returns it, with ``async_op=True``).
    """
    comm = resolve(group, "allreduce")
    rank = comm.rank
    buf = adapt(tensor, "tensor", "allreduce", rank, write=True)
    if op.__class__ is not ReduceOp:
        op = as_reduce_op(op, "allreduce", rank)
    mop = mpi_op(op, buf.dt, "allreduce", rank)
    if hierarchical is None:
        hierarchical = getattr(group, "hierarchical", False)
    comm.seq += 1
    if comm.checking:
        comm.verify("allreduce", {"shape": buf.shape, "dtype": buf.dt.name, "op": op.name,
                                  "hierarchical": bool(hierarchical)})
    if hierarchical and comm.size > 1:
        work = Work(comm, "allreduce", buf, _hierarchical(comm, buf, op, mop, tensor))
        return work if async_op else work.wait()
    accounting.record("allreduce", buf.nbytes, comm.size)
    if async_op:
        return Work(comm, "allreduce", buf, _flat_async(comm, buf, op, mop, tensor))
    blocking(comm, "allreduce", buf, comm.mpi.Allreduce, IN_PLACE, buf.msg(), mop)
    finish_reduce(buf, op, comm.size)
    return tensor


def _flat_async(comm: Communicator, buf: Buf, op: ReduceOp, mop: Any, tensor: Any) -> Any:
    yield comm.mpi.Iallreduce(IN_PLACE, buf.msg(), mop)
    finish_reduce(buf, op, comm.size)
    return tensor


def _hierarchical(comm: Communicator, buf: Buf, op: ReduceOp, mop: Any, tensor: Any) -> Any:
    local, leaders = comm.node()
    msg = buf.msg()
    if local.size > 1:
        accounting.record("reduce", buf.nbytes, local.size)
        send = IN_PLACE if local.rank == 0 else msg
        recv = msg if local.rank == 0 else None
        yield local.mpi.Ireduce(send, recv, mop, root=0)
    if leaders is not None and leaders.size > 1:
        accounting.record("allreduce", buf.nbytes, leaders.size)
        yield leaders.mpi.Iallreduce(IN_PLACE, msg, mop)
    if local.size > 1:
        accounting.record("broadcast", buf.nbytes, local.size)
        yield local.mpi.Ibcast(msg, root=0)
    finish_reduce(buf, op, comm.size)
    return tensor
