"""reduce_scatter: the reduction of all ranks' buffers, split into one block per rank.

Split rule (the rule of ``numpy.array_split``): the flattened input of ``L`` elements is
cut into ``n`` consecutive blocks; the first ``L % n`` ranks get ``L // n + 1`` elements and
the others ``L // n``. Any ``L`` works, 0 included; blocks differ by at most one element.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from ..base import accounting
from ..base.buffers import Buf, adapt, output
from ..base.reduce_ops import ReduceOp, as_reduce_op, mpi_op
from . import node_shm
from ._base import blocking, finish_reduce, resolve
from .work import Work


def block_sizes(length: int, n: int) -> list[int]:
    """Elements of each rank's block for a flattened input of ``length`` elements."""
    return list(_block_sizes(length, n))


@lru_cache(maxsize=256)
def _block_sizes(length: int, n: int) -> tuple[int, ...]:
    base, extra = divmod(length, n)
    return tuple(base + 1 if r < extra else base for r in range(n))


def block_offsets(length: int, n: int) -> list[int]:
    """Start index of each rank's block in the flattened input."""
    sizes = block_sizes(length, n)
    return [sum(sizes[:r]) for r in range(n)]


def reduce_scatter(tensor: Any, op: ReduceOp = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False, out: Any = None) -> Any:
    """Reduce ``tensor`` over ``group`` and return this rank's block of the result.

    Every rank passes the same shape and dtype; the input is only read. Returns a new 1-D
    array/tensor (input's kind, dtype, device) of ``block_sizes(tensor.size, n)[rank]``
    elements: elements ``[offset, offset + size)`` of the flattened reduction.
    ``out``: an optional result buffer to fill instead of allocating one (same kind, device
    and dtype as the input, the result's number of elements); it is what is returned.
    """
    comm = resolve(group, "reduce_scatter")
    rank = comm.rank
    buf = adapt(tensor, "tensor", "reduce_scatter", rank)
    if op.__class__ is not ReduceOp:
        op = as_reduce_op(op, "reduce_scatter", rank)
    mop = mpi_op(op, buf.dt, "reduce_scatter", rank)
    comm.seq += 1
    if comm.checking:
        comm.verify("reduce_scatter", {"shape": buf.shape, "dtype": buf.dt.name, "op": op.name})
    counts = _block_sizes(buf.count, comm.size)
    out = output(buf, (counts[rank],), "reduce_scatter", rank, out)
    if not async_op and node_shm.use(comm, buf, "reduce_scatter"):  # one node: shared memory
        return node_shm.reduce_scatter(comm, buf, out, op, counts)
    accounting.record("reduce_scatter", buf.nbytes, comm.size)
    if async_op:
        stages = _async(comm.mpi.Ireduce_scatter, buf, out, counts, mop, op, comm.size)
        return Work(comm, "reduce_scatter", buf, stages)
    blocking(comm, "reduce_scatter", buf, comm.mpi.Reduce_scatter, buf.msg(), out.msg(),
             counts, mop)
    buf.finish()
    finish_reduce(out, op, comm.size)
    return out.obj


def _async(start: Any, buf: Buf, out: Buf, counts: Sequence[int], mop: Any, op: ReduceOp,
           n: int) -> Any:
    yield start(buf.msg(), out.msg(), counts, mop)
    buf.finish()
    finish_reduce(out, op, n)
    return out.obj
