"""allreduce_from: the reduction of every rank's concatenated pieces, written into one flat
buffer, the gathering copy fused into the collective where the shared-memory tier takes it."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..base.buffers import adapt
from ..base.errors import where
from ..base.options import options
from ..base.reduce_ops import ReduceOp, as_reduce_op, mpi_op
from . import node_shm
from ._base import resolve
from .allreduce import allreduce


def allreduce_from(pieces: Sequence[Any], out: Any, op: ReduceOp = ReduceOp.SUM,
                   group: Any = None, async_op: bool = False,
                   hierarchical: bool | None = None) -> Any:
    """Reduce the concatenation of ``pieces`` over every rank of ``group`` into ``out``.

    ``out``: a contiguous 1-D host buffer (numpy array or CPU torch tensor) whose length is
    the pieces' total; ``pieces``: contiguous buffers of ``out``'s dtype (any shapes; a
    piece may be the very slice of ``out`` it stands for, e.g. a gradient already bound to
    its bucket view). Every rank passes the same sizes in the same order. On return (or
    after ``wait()`` with ``async_op=True``) ``out`` holds on every rank what
    ``allreduce(cat(pieces), op, hierarchical=hierarchical)`` holds (``None``: the group's
    default); the pieces are left as they were, apart from those that are slices of
    ``out`` (each must then be the slice at its own offset).

    This is DDP's "copy the gradients into the bucket, then allreduce the bucket" in one
    pass: where the node's shared-memory tier takes the allreduce
    (``commlib.primitives.node_shm.use``), each rank copies its pieces straight into its
    shared segment, one step at a time, and no separate copy into ``out`` is made (at 2
    ranks, 4 instead of 5 bytes of memory traffic per byte of bucket, and no pass over
    memory that has left the cache); the tier's call is blocking even with
    ``async_op=True`` (the returned tensor then stands for a completed operation).
    Elsewhere the pieces are copied into ``out`` and :func:`commlib.allreduce` runs as
    usual (``async_op`` honoured). Floating-point results are exactly those of
    :func:`commlib.allreduce` on the same ``out`` by the same path.
    """
    comm = resolve(group, "allreduce_from")
    rank = comm.rank
    buf = adapt(out, "out", "allreduce_from", rank, write=True)
    if len(buf.shape) != 1:
        raise ValueError(f"{where('allreduce_from', rank)}: out must be 1-D, got shape "
                         f"{tuple(buf.shape)}")
    sizes = [_numel(p, out, i, rank) for i, p in enumerate(pieces)]
    if sum(sizes) != buf.count:
        raise ValueError(f"{where('allreduce_from', rank)}: the pieces hold {sum(sizes)} "
                         f"elements, out holds {buf.count}")
    if op.__class__ is not ReduceOp:
        op = as_reduce_op(op, "allreduce_from", rank)
    if hierarchical is None:
        hierarchical = bool(getattr(group, "hierarchical", False)) if group is not None \
            else False
    host = (buf.mem.__class__ is np.ndarray and buf._staging is None and buf._after is None)
    if host and comm.size > 1 and not hierarchical and node_shm.use(comm, buf, "allreduce"):
        arrays = [_host(p, buf.mem, i, rank) for i, p in enumerate(pieces)]
        mpi_op(op, buf.dt, "allreduce_from", rank)  # op valid for the dtype, or raises
        comm.seq += 1
        if options.check:
            comm.verify("allreduce", {"shape": buf.shape, "dtype": buf.dt.name,
                                      "op": op.name, "hierarchical": False})
        return node_shm.allreduce_from(comm, arrays, buf, op, out)
    offset = 0
    for p, n in zip(pieces, sizes):
        target = out[offset:offset + n]
        if isinstance(target, np.ndarray):
            if not np.shares_memory(p, target):
                np.copyto(target, np.asarray(p).reshape(-1))
        elif p.data_ptr() != target.data_ptr():
            target.copy_(p.reshape(-1))
        offset += n
    return allreduce(out, op=op, group=group, async_op=async_op, hierarchical=hierarchical)


def _numel(piece: Any, out: Any, i: int, rank: int) -> int:
    """Elements of ``piece``, which must be of ``out``'s kind (numpy or torch) and dtype."""
    if type(piece).__module__.split(".")[0] != type(out).__module__.split(".")[0] \
            or getattr(piece, "dtype", None) != out.dtype:
        raise TypeError(f"{where('allreduce_from', rank)}: pieces[{i}] must be of out's "
                        f"kind and dtype ({type(out).__name__}, {out.dtype}), got "
                        f"{type(piece).__name__} of {getattr(piece, 'dtype', None)}")
    return int(piece.numel() if callable(piece.size) else piece.size)


def _host(piece: Any, flat: np.ndarray, i: int, rank: int) -> np.ndarray:
    """``piece`` as a 1-D numpy array of ``flat``'s host dtype (no copy)."""
    mem = adapt(piece, f"pieces[{i}]", "allreduce_from", rank).mem
    if mem.__class__ is not np.ndarray or not mem.flags.c_contiguous:
        raise TypeError(f"{where('allreduce_from', rank)}: pieces[{i}] must be contiguous "
                        f"host memory (numpy or a CPU tensor)")
    if mem.dtype != flat.dtype:
        raise TypeError(f"{where('allreduce_from', rank)}: pieces[{i}] has dtype "
                        f"{mem.dtype}, out has {flat.dtype}")
    return mem.reshape(-1)
