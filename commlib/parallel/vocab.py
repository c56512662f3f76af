"""Vocabulary-sharded embedding and classifier loss (Megatron-LM style) over a commlib
group: each rank holds a block of the vocabulary (:func:`commlib.block_sizes` rule)."""
from __future__ import annotations

from typing import Any

import torch

from ..base.reduce_ops import ReduceOp
from ..primitives import block_offsets, block_sizes
from .layers import _check, _group

_REDUCTIONS = ("mean", "sum", "none")


class _LookupReduce(torch.autograd.Function):
    """All-reduce (sum) of this rank's partial lookup, with one flag riding along: the
    number of ranks that found an id outside the vocabulary. Identity backward."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, bad: bool, group: Any) -> tuple:
        flat = torch.cat([out.reshape(-1), torch.tensor([float(bad)], dtype=out.dtype)])
        if group.size > 1:
            group.allreduce(flat)
        return flat[:-1].view_as(out), float(flat[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _flag: Any) -> tuple:
        return grad, None, None


class VocabParallelEmbedding(torch.nn.Module):
    """``torch.nn.Embedding`` with its rows (the vocabulary) split over ``group``.

    ``weight``: this rank's ``(vocab_k, embedding_dim)`` rows (``vocab_k =
    block_sizes(num_embeddings, k)[rank]``, starting at row ``start``). Input: integer ids
    of any shape, the same on every rank; output ``(*ids.shape, embedding_dim)`` on every
    rank (each rank looks up the ids in its block, zeros elsewhere, then one all-reduce).
    An id outside ``[0, num_embeddings)`` raises ``IndexError`` on every rank (as
    ``nn.Embedding`` does; a flag in the all-reduce agrees on it), nothing is returned.

    ``padding_idx``, ``max_norm``, ``norm_type``: as ``torch.nn.Embedding`` (a negative
    ``padding_idx`` counts from the end): the padding row is zero-initialised and never
    gets a gradient (the rank holding it passes it to ``F.embedding``); with ``max_norm``
    each rank renormalises, in place, the rows of its block that ``ids`` look up and whose
    ``norm_type``-norm exceeds ``max_norm`` (torch's ``embedding_renorm_``), before the
    lookup. ``scale_grad_by_freq`` and ``sparse`` are not supported."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Any = None,
                 device: Any = None, dtype: Any = None, *, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0) -> None:
        super().__init__()
        self.group = _group(group)
        _check(self.group, num_embeddings, "VocabParallelEmbedding")
        if padding_idx is not None:
            if isinstance(padding_idx, bool) or not isinstance(padding_idx, int) or \
                    not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"commlib.parallel.VocabParallelEmbedding (rank "
                                 f"{self.group.rank}): argument 'padding_idx'={padding_idx!r} "
                                 f"must be an int in [-{num_embeddings}, {num_embeddings})")
            padding_idx %= num_embeddings
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"commlib.parallel.VocabParallelEmbedding (rank "
                             f"{self.group.rank}): argument 'max_norm'={max_norm!r} must be "
                             f"a positive float or None")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = padding_idx, max_norm, norm_type
        k, r = self.group.size, self.group.rank
        self.start = block_offsets(num_embeddings, k)[r]
        self.local = block_sizes(num_embeddings, k)[r]
        full = torch.nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx,
                                  device=device, dtype=dtype)
        self.weight = torch.nn.Parameter(full.weight.detach()[self.start:self.start + self.local]
                                         .clone())
        self.weight.tensor_parallel = True

    @property
    def local_padding_idx(self) -> int | None:
        """The padding row's index in this rank's block, None when another rank holds it."""
        p = self.padding_idx
        return p - self.start if p is not None and 0 <= p - self.start < self.local else None

    @classmethod
    def from_embedding(cls, embedding: torch.nn.Embedding,
                       group: Any = None) -> VocabParallelEmbedding:
        """The sharded equivalent of ``embedding`` (the same weights on every rank), with
        its ``padding_idx``, ``max_norm``, ``norm_type`` and ``requires_grad``."""
        rank = _group(group).rank
        for name in ("scale_grad_by_freq", "sparse"):
            if getattr(embedding, name, False):
                raise ValueError(f"commlib.parallel.VocabParallelEmbedding.from_embedding "
                                 f"(rank {rank}): argument 'embedding' has {name}=True, "
                                 f"which is not supported")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group,
                    embedding.weight.device, embedding.weight.dtype,
                    padding_idx=embedding.padding_idx, max_norm=embedding.max_norm,
                    norm_type=embedding.norm_type)
        with torch.no_grad():
            layer.weight.copy_(embedding.weight[layer.start:layer.start + layer.local])
        layer.weight.requires_grad_(embedding.weight.requires_grad)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rank = self.group.rank
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or \
                ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"commlib.parallel.VocabParallelEmbedding (rank {rank}): "
                            f"argument 'ids' must be an integer tensor, got "
                            f"{getattr(ids, 'dtype', type(ids).__name__)}")
        n = self.num_embeddings
        outside = (ids < 0) | (ids >= n)
        bad = bool(outside.any())
        inside = (ids >= self.start) & (ids < self.start + self.local)
        local = torch.where(inside, ids - self.start, torch.zeros_like(ids))
        if self.max_norm is not None and not bad:
            with torch.no_grad():  # as F.embedding: only the rows the ids look up
                torch.embedding_renorm_(self.weight.detach(), local[inside].contiguous(),
                                        self.max_norm, self.norm_type)
        out = torch.nn.functional.embedding(local, self.weight, self.local_padding_idx)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        out, flag = _LookupReduce.apply(out, bad, self.group)
        if flag != 0:
            if bad:
                lo, hi = int(ids.min()), int(ids.max())
                detail = f"got ids from {lo} to {hi}"
            else:
                detail = "another rank got such ids (ids must be the same on every rank)"
            raise IndexError(f"commlib.parallel.VocabParallelEmbedding (rank {rank}): "
                             f"argument 'ids' must lie in [0, {n}) (num_embeddings={n}); "
                             f"{detail}")
        return out

    def extra_repr(self) -> str:
        s = (f"{self.num_embeddings}, {self.embedding_dim} (rows {self.start}.."
             f"{self.start + self.local - 1} here)")
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.max_norm is not None:
            s += f", max_norm={self.max_norm}, norm_type={self.norm_type}"
        return s


class _ParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any,
                start: int, vocab: int, ignore_index: int, reduction: str,
                smoothing: float) -> torch.Tensor:
        logits = logits.detach()
        rank = group.rank
        valid = target != ignore_index
        ids = target[valid]
        # one MAX all-reduce agrees on the row maxima and on the range of the targets
        inf = float("inf")
        lo = float(ids.min()) if ids.numel() else inf
        hi = float(ids.max()) if ids.numel() else -inf
        top = logits.max(dim=-1).values if logits.shape[-1] else \
            torch.full(logits.shape[:-1], -inf, dtype=logits.dtype)
        agreed = torch.cat([top.reshape(-1).to(torch.float64),
                            torch.tensor([hi, -lo], dtype=torch.float64)])
        if group.size > 1:
            group.allreduce(agreed, op=ReduceOp.MAX)
        hi, lo = float(agreed[-2]), -float(agreed[-1])
        if hi >= vocab or lo < 0:
            raise IndexError(f"commlib.parallel.parallel_cross_entropy (rank {rank}): "
                             f"argument 'target' must hold class ids in [0, {vocab}) (the "
                             f"vocabulary) or ignore_index={ignore_index}; got ids from "
                             f"{lo:.0f} to {hi:.0f}")
        top = agreed[:-2].to(logits.dtype).view(top.shape)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        width = logits.shape[-1]
        inside = valid & (target >= start) & (target < start + width)
        local = torch.where(inside, target - start, torch.zeros_like(target))
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside.to(logits.dtype)
        sums = [exp.sum(dim=-1), picked]
        if smoothing:
            sums.append(shifted.sum(dim=-1))
        both = torch.stack(sums).contiguous()
        if group.size > 1:
            group.allreduce(both)
        log_total = both[0].log()
        nll = log_total - both[1]
        if smoothing:  # -sum_c log p_c = V log(total) - sum_c shifted_c
            loss = (1 - smoothing) * nll + (smoothing / vocab) * (vocab * log_total - both[2])
        else:
            loss = nll
        mask = valid.to(logits.dtype)
        loss = loss * mask
        count = int(valid.sum())
        if reduction == "mean":
            # as torch: NaN when every target is ignored; the gradient is then zero
            out = loss.sum() / count
            coef = mask / count if count else torch.zeros_like(mask)
        elif reduction == "sum":
            out, coef = loss.sum(), mask
        else:
            out, coef = loss, mask
        ctx.reduction, ctx.smoothing, ctx.vocab = reduction, smoothing, vocab
        ctx.save_for_backward(exp / both[0].unsqueeze(-1), local, inside, coef)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # d loss_i / d logit_ic = p_ic - (1 - eps) [c == target_i] - eps / V
        soft, local, inside, coef = ctx.saved_tensors
        g = soft.clone()
        if ctx.smoothing:
            g -= ctx.smoothing / ctx.vocab
        g.scatter_add_(-1, local.unsqueeze(-1),
                       -(1 - ctx.smoothing) * inside.to(g.dtype).unsqueeze(-1))
        scale = coef * grad  # grad: a scalar, or one value per target under "none"
        return g * scale.unsqueeze(-1), None, None, None, None, None, None, None


def parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Any = None,
                           vocab_size: int | None = None, ignore_index: int = -100,
                           reduction: str = "mean",
                           label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy of ``(*, vocab)`` logits held as column blocks over ``group`` (this
    rank's ``(*, vocab_k)`` block, e.g. a :class:`ColumnParallelLinear` with
    ``gather_output=False``), without gathering them: the row maxima and the targets' range
    (one MAX all-reduce), then the sums of exponentials and the targets' logits (one sum
    all-reduce of ``2 x N`` values, ``3 x N`` with label smoothing) cross the group.

    ``target``: class ids of shape ``logits.shape[:-1]`` (int64 or uint8, as torch), the
    same on every rank; the class dimension is the last one (``(N, vocab)`` as torch's
    ``(N, C)``; for more dims torch puts the classes at dim 1). ``ignore_index``,
    ``reduction`` (``'mean'``: over the targets not ignored, NaN when all are;
    ``'sum'``; ``'none'``: one loss per target, 0 where ignored) and ``label_smoothing``
    (the mixture ``(1 - eps) * nll + eps * mean_c(-log p_c)`` over the whole vocabulary)
    follow ``torch.nn.functional.cross_entropy`` exactly; class-probability targets and
    ``weight`` are not supported. A target outside ``[0, vocab)`` that is not
    ``ignore_index`` raises ``IndexError`` on every rank. Returns the same value on every
    rank, equal to ``torch.nn.functional.cross_entropy`` of the whole logits; the gradient
    flows to this rank's block. ``vocab_size`` (default: the sum of the blocks) sets the
    block offsets."""
    group = _group(group)
    rank = group.rank
    name = "commlib.parallel.parallel_cross_entropy"
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{name} (rank {rank}): argument 'reduction'={reduction!r} must be "
                         f"one of {_REDUCTIONS}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{name} (rank {rank}): argument 'label_smoothing'="
                         f"{label_smoothing!r} must be a float in [0.0, 1.0]")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{name} (rank {rank}): argument 'ignore_index' must be an int, got "
                        f"{type(ignore_index).__name__}")
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1 or \
            not logits.is_floating_point():
        raise TypeError(f"{name} (rank {rank}): argument 'logits' must be a floating-point "
                        f"tensor of shape (*, vocab_k)")
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.uint8):
        got = getattr(target, "dtype", type(target).__name__)
        raise TypeError(f"{name} (rank {rank}): argument 'target' must be an int64 (or "
                        f"uint8) tensor of class ids, got {got} (class-probability targets "
                        f"are not supported)")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{name} (rank {rank}): argument 'target' has shape "
                         f"{tuple(target.shape)}; logits of shape {tuple(logits.shape)} need "
                         f"{tuple(logits.shape[:-1])}")
    if vocab_size is None:
        vocab_size = int(group.allreduce(torch.tensor([logits.shape[-1]]))[0])
    start = block_offsets(vocab_size, group.size)[rank]
    if logits.shape[-1] != block_sizes(vocab_size, group.size)[rank]:
        raise ValueError(f"{name} (rank {rank}): "
                         f"argument 'logits' has {logits.shape[-1]} columns, block "
                         f"{rank} of a vocabulary of {vocab_size} over {group.size} "
                         f"ranks has {block_sizes(vocab_size, group.size)[rank]}")
    return _ParallelCrossEntropy.apply(logits, target.long(), group, start, vocab_size,
                                       ignore_index, reduction, float(label_smoothing))
