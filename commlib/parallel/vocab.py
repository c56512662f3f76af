"""Vocabulary-sharded embedding and classifier loss (Megatron-LM style) over a commlib
group: each rank holds a block of the vocabulary (:func:`commlib.block_sizes` rule)."""
from __future__ import annotations

from typing import Any

import torch

from ..primitives import block_offsets, block_sizes
from ..reduce_ops import ReduceOp
from .layers import _check, _group, _ReduceFromGroup


class VocabParallelEmbedding(torch.nn.Module):
    """``torch.nn.Embedding`` with its rows (the vocabulary) split over ``group``.

    ``weight``: this rank's ``(vocab_k, embedding_dim)`` rows. Input: integer ids of any
    shape, the same on every rank; output ``(*ids.shape, embedding_dim)`` on every rank
    (each rank looks up the ids in its block, zeros elsewhere, then an all-reduce)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Any = None,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.group = _group(group)
        _check(self.group, num_embeddings, "VocabParallelEmbedding")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        k, r = self.group.size, self.group.rank
        self.start = block_offsets(num_embeddings, k)[r]
        self.local = block_sizes(num_embeddings, k)[r]
        full = torch.nn.Embedding(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.weight = torch.nn.Parameter(full.weight.detach()[self.start:self.start + self.local]
                                         .clone())
        self.weight.tensor_parallel = True

    @classmethod
    def from_embedding(cls, embedding: torch.nn.Embedding,
                       group: Any = None) -> "VocabParallelEmbedding":
        """The sharded equivalent of ``embedding`` (the same weights on every rank)."""
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group,
                    embedding.weight.device, embedding.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(embedding.weight[layer.start:layer.start + layer.local])
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inside = (ids >= self.start) & (ids < self.start + self.local)
        local = torch.where(inside, ids - self.start, torch.zeros_like(ids))
        out = torch.nn.functional.embedding(local, self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return _ReduceFromGroup.apply(out, self.group)


class _ParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any,
                start: int) -> torch.Tensor:
        logits = logits.detach()
        top = logits.max(dim=-1).values.contiguous()
        if group.size > 1:
            group.allreduce(top, op=ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1).contiguous()
        width = logits.shape[-1]
        inside = (target >= start) & (target < start + width)
        local = torch.where(inside, target - start, torch.zeros_like(target))
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside.to(logits.dtype)
        both = torch.stack([total, picked.contiguous()])
        if group.size > 1:
            group.allreduce(both)
        total, picked = both[0], both[1]
        loss = total.log() - picked
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, inside)
        return loss.mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        soft, local, inside = ctx.saved_tensors
        g = soft.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        return g * (grad / local.numel()), None, None, None


def parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Any = None,
                           vocab_size: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``(N, vocab)`` logits held as column blocks over ``group``
    (this rank's ``(N, vocab_k)`` block, e.g. a :class:`ColumnParallelLinear` with
    ``gather_output=False``), without gathering them: max, sum of exponentials and the
    target's logit are all-reduced (``N`` floats each). ``target``: ``(N,)`` class ids, the
    same on every rank. Returns the same scalar on every rank, equal to
    ``torch.nn.functional.cross_entropy`` of the whole logits; the gradient flows to this
    rank's block. ``vocab_size`` (default: the sum of the blocks) sets the block offsets."""
    group = _group(group)
    if vocab_size is None:
        vocab_size = int(group.allreduce(torch.tensor([logits.shape[-1]]))[0])
    start = block_offsets(vocab_size, group.size)[group.rank]
    if logits.shape[-1] != block_sizes(vocab_size, group.size)[group.rank]:
        raise ValueError(f"commlib.parallel.parallel_cross_entropy (rank {group.rank}): "
                         f"argument 'logits' has {logits.shape[-1]} columns, block "
                         f"{group.rank} of a vocabulary of {vocab_size} over {group.size} "
                         f"ranks has {block_sizes(vocab_size, group.size)[group.rank]}")
    return _ParallelCrossEntropy.apply(logits, target, group, start)
