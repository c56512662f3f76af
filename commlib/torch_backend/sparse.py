"""Sparse ``all_reduce``, as gloo does it: every rank's indices and values gathered, the
sum coalesced.

torch's DDP sends the gradients of ``nn.Embedding(sparse=True)`` (and any sparse
gradient) through ``all_reduce``. For a sparse COO tensor of the same size on every rank,
the result (in place, on every rank) is the coalesced sum of all ranks' tensors: the
indices and values of rank 0, then rank 1, ... concatenated, then coalesced (duplicates
summed), which is what gloo computes. Only ``ReduceOp.SUM`` (gloo's only sparse
reduction); other ops, other sparse layouts and sparse tensors in other collectives raise
:class:`.UnsupportedOperation` naming the operation. Three small exchanges (a fixed-size
header, the sizes, then indices and values padded to the largest count), so ranks that
disagree on the size or dtype all raise the same ``ValueError`` instead of hanging.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import primitives as P
from ..base.reduce_ops import ReduceOp
from .convert import unsupported, where

#: dtypes by code, for the header exchange (every dtype commlib carries)
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
           torch.complex64, torch.complex128]


def all_reduce(tensor: Any, op: ReduceOp, group: P.Group, complete: Callable[[Any], Any],
               rank: int) -> Any:
    """Sum the sparse COO ``tensor`` over ``group``, in place on every rank; returns it.
    ``complete(work)`` completes one started commlib operation (within the group's
    timeout) and returns its value."""
    if op is not ReduceOp.SUM:
        raise unsupported(f"all_reduce of a sparse tensor with ReduceOp.{op.name}", rank,
                          "sparse tensors are reduced with ReduceOp.SUM only, as by gloo")
    if tensor.layout != torch.sparse_coo:
        raise unsupported(f"all_reduce of a {tensor.layout} tensor", rank,
                          "sparse tensors must be in the COO layout (torch.sparse_coo)")
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"{where('all_reduce', rank)}: sparse tensor of dtype {tensor.dtype}"
                        f" cannot be reduced")
    local = tensor.detach().coalesce()
    indices = local.indices().t().contiguous()            # (nnz, sparse_dim)
    values = local.values().contiguous()                  # (nnz, *dense shape)
    header = torch.tensor([indices.shape[0], local.dim(), local.sparse_dim(),
                           _DTYPES.index(tensor.dtype)], dtype=torch.int64)
    headers = complete(P.allgather(header, group, True))  # (n, 4)
    if len({tuple(h[1:].tolist()) for h in headers}) != 1:
        raise ValueError(_mismatch("number of dimensions, sparse dimensions or dtype",
                                   headers[:, 1:].tolist(), rank))
    sizes = complete(P.allgather(torch.tensor(local.shape, dtype=torch.int64), group, True))
    if len({tuple(s.tolist()) for s in sizes}) != 1:
        raise ValueError(_mismatch("size", sizes.tolist(), rank))
    counts = headers[:, 0].tolist()
    most = max(counts)
    padded_indices = indices.new_zeros((most, indices.shape[1]))
    padded_indices[:indices.shape[0]] = indices
    padded_values = values.new_zeros((most,) + tuple(values.shape[1:]))
    padded_values[:values.shape[0]] = values
    all_indices = complete(P.allgather(padded_indices, group, True))
    all_values = complete(P.allgather(padded_values, group, True))
    total = torch.sparse_coo_tensor(
        torch.cat([all_indices[r, :k] for r, k in enumerate(counts)]).t(),
        torch.cat([all_values[r, :k] for r, k in enumerate(counts)]),
        local.shape).coalesce()
    with torch.no_grad():
        tensor.copy_(total)
    return tensor


def _mismatch(what: str, per_rank: list, rank: int) -> str:
    detail = "; ".join(f"rank {r}: {v}" for r, v in enumerate(per_rank))
    return (f"{where('all_reduce', rank)}: the ranks' sparse tensors differ in their "
            f"{what}: {detail}")
