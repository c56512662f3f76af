"""allreduce: every rank ends with the reduction of all ranks' buffers, in place."""
from __future__ import annotations

from typing import Any

from mpi4py import MPI

from ..base import accounting
from ..base.buffers import Buf, adapt
from ..base.options import options
from ..base.reduce_ops import ReduceOp, as_reduce_op, mpi_op
from ..core import runtime
from ..core.communicator import Communicator
from . import node_shm
from ._base import call_blocking, finish_reduce, resolve
from .work import Release, Reserve, Turn, Work

IN_PLACE = MPI.IN_PLACE
_AVG = ReduceOp.AVG
_SUM = ReduceOp.SUM
_MPI_SUM = MPI.SUM


def allreduce(tensor: Any, op: ReduceOp = ReduceOp.SUM, group: Any = None,
              async_op: bool = False, hierarchical: bool | None = None) -> Any:
    """Reduce ``tensor`` over all ranks of ``group``, in place, on every rank.

    ``tensor``: numpy array, torch tensor (CPU or CUDA) or cupy array of any shape and of a
    dtype MPI carries (see :mod:`commlib.base.dtypes`); every rank passes the same shape and
    dtype. ``op``: a :class:`ReduceOp` (AVG = SUM / group size, floating point only).
    ``hierarchical``: reduce inside each node, allreduce among node leaders, broadcast inside
    each node (same result as the flat algorithm up to floating-point summation order);
    ``None`` takes the group's default. Returns ``tensor`` (or a :class:`Work` whose
    ``wait()`` returns it, with ``async_op=True``).

    Inside one node the node's shared memory may carry it
    (:mod:`commlib.primitives.node_shm`: blocking calls at the sizes where it was measured
    faster, nonblocking flat ones of host memory from 4 MiB on where it is too, run by the
    window's own thread in issue order); ``COMMLIB_SHM=0`` keeps everything on MPI.
    """
    if group is None:
        comm = runtime._world
        if comm is None:
            comm = resolve(None, "allreduce")
        if hierarchical is None:
            hierarchical = False
    else:
        comm = resolve(group, "allreduce")
        if hierarchical is None:
            hierarchical = getattr(group, "hierarchical", False)
    rank = comm.rank
    buf = adapt(tensor, "tensor", "allreduce", rank, write=True)
    dt = buf.dt
    if op is _SUM and dt.native_reduce and dt.kind != "b":
        mop = _MPI_SUM  # what mpi_op answers for this case, without the lookup
    else:
        if op.__class__ is not ReduceOp:
            op = as_reduce_op(op, "allreduce", rank)
        mop = mpi_op(op, dt, "allreduce", rank)
    comm.seq += 1
    if options.check:  # comm.checking
        comm.verify("allreduce", {"shape": buf.shape, "dtype": buf.dt.name, "op": op.name,
                                  "hierarchical": bool(hierarchical)})
    if hierarchical and comm.size > 1:
        if not async_op and node_shm.use_hierarchical(comm, buf):  # node tier: shared memory
            return node_shm.hierarchical_allreduce(comm, buf, op, mop, tensor)
        work = Work(comm, "allreduce", buf, _hierarchical(comm, buf, op, mop, tensor))
        return work if async_op else work.wait()
    if async_op:
        if options.shm != "0" and node_shm.use_async(comm, buf, "allreduce"):
            # one node: through shared memory, run by the window's thread
            return node_shm.start_allreduce(comm, buf, op, tensor)
        accounting.record("allreduce", buf.nbytes, comm.size)
        return Work(comm, "allreduce", buf, _flat_async(comm, buf, op, mop, tensor))
    if node_shm.use(comm, buf, "allreduce"):  # one node: shared memory
        return node_shm.allreduce(comm, buf, op, tensor)
    call_blocking(comm, "allreduce", buf, buf.count * dt.host.itemsize, comm.mpi.Allreduce,
                  (IN_PLACE, [buf.mem, buf.count, dt.mpi], mop))
    if op is _AVG or buf._after is not None or buf._staging is not None:
        finish_reduce(buf, op, comm.size)
    return tensor


def _flat_async(comm: Communicator, buf: Buf, op: ReduceOp, mop: Any, tensor: Any) -> Any:
    yield comm.mpi.Iallreduce(IN_PLACE, buf.msg(), mop)
    finish_reduce(buf, op, comm.size)
    return tensor


# Pipelined hierarchical allreduce: at least this many bytes per chunk, at most this many
# chunks. Chunk c's inter-node allreduce runs while chunk c+1 is reduced inside the node
# and chunk c-1 is broadcast inside it, so the node-local steps hide behind the slow tier.
PIPELINE_CHUNK_BYTES = 1 << 20
PIPELINE_MAX_CHUNKS = 8


def _hierarchical(comm: Communicator, buf: Buf, op: ReduceOp, mop: Any, tensor: Any) -> Any:
    local, leaders = comm.node()
    bcast = comm.node_broadcast()
    # The same decision on every rank: it depends on the buffer and on whether any node
    # has more than one rank (then some rank leads no node, so no leaders' group spans
    # the whole communicator).
    flat_world = leaders is not None and leaders.size == comm.size
    node_steps = local.size > 1
    # the leaders' communicator where this rank takes part in an allreduce across nodes
    across = leaders if leaders is not None and leaders.size > 1 else None
    # Tickets at issue: every stage starts in issue order on its communicator, whatever
    # order the caller waits in (see commlib.primitives.work).
    yield Reserve(*([local, bcast] if node_steps else []), *([across] if across else []))
    chunks = [] if flat_world else _chunks(buf)
    if len(chunks) > 1:
        yield from _pipelined(local, bcast, across, buf, chunks, mop)
        finish_reduce(buf, op, comm.size)
        return tensor
    msg = buf.msg()
    if node_steps:
        accounting.record("reduce", buf.nbytes, local.size)
        send = IN_PLACE if local.rank == 0 else msg
        recv = msg if local.rank == 0 else None
        yield Turn(local)
        request = local.mpi.Ireduce(send, recv, mop, root=0)
        yield Release(local)
        yield request
    if across:
        accounting.record("allreduce", buf.nbytes, across.size)
        yield Turn(across)
        request = across.mpi.Iallreduce(IN_PLACE, msg, mop)
        yield Release(across)
        yield request
    if node_steps:
        accounting.record("broadcast", buf.nbytes, local.size)
        yield Turn(bcast)
        request = bcast.mpi.Ibcast(msg, root=0)
        yield Release(bcast)
        yield request
    finish_reduce(buf, op, comm.size)
    return tensor


def _chunks(buf: Buf) -> list[list[Any]]:
    """``buf`` as consecutive ``[memory, count, datatype]`` pieces for the pipeline (host
    memory only; one piece when the buffer is small or device memory)."""
    import numpy as np
    mem = buf.mem
    if not isinstance(mem, np.ndarray) or buf.nbytes < 2 * PIPELINE_CHUNK_BYTES:
        return []
    k = min(PIPELINE_MAX_CHUNKS, buf.nbytes // PIPELINE_CHUNK_BYTES)
    flat = mem.reshape(-1)
    bounds = [buf.count * i // k for i in range(k + 1)]
    return [[flat[lo:hi], hi - lo, buf.dt.mpi] for lo, hi in zip(bounds, bounds[1:])]


def _pipelined(local: Communicator, bcast: Communicator, leaders: Communicator | None,
               buf: Buf, chunks: list[list[Any]], mop: Any) -> Any:
    """The node reduce, leaders' allreduce and node broadcast of each chunk, overlapped
    (``leaders``: None when this rank does not take part in an allreduce across nodes).
    Every rank of a node starts its reduces at issue, its broadcasts (on ``bcast``) in
    chunk order; a non-leader broadcasts into chunk c only after its reduce of chunk c
    completed (MPI owns a send buffer until then)."""
    node_steps = local.size > 1
    lead = local.rank == 0
    if node_steps:
        accounting.record("reduce", buf.nbytes, local.size)
        accounting.record("broadcast", buf.nbytes, local.size)
    if leaders is not None:
        accounting.record("allreduce", buf.nbytes, leaders.size)
    reduces: list[Any] = [None] * len(chunks)
    if node_steps:
        yield Turn(local)
        reduces = [local.mpi.Ireduce(IN_PLACE if lead else m, m if lead else None, mop,
                                     root=0) for m in chunks]
        yield Release(local)
    done = reduces
    if leaders is not None:
        done = []
        yield Turn(leaders)
        for m, r in zip(chunks, reduces):
            if r is not None:
                yield r
            done.append(leaders.mpi.Iallreduce(IN_PLACE, m, mop))
        yield Release(leaders)
    broadcasts = []
    if node_steps:
        yield Turn(bcast)
    for m, r in zip(chunks, done):
        if r is not None:
            yield r
        if node_steps:
            broadcasts.append(bcast.mpi.Ibcast(m, root=0))
    if node_steps:
        yield Release(bcast)
    for r in broadcasts:
        yield r
    return None
