"""The even flat partition of ZeRO stage 1 (:class:`commlib.ZeroRedundancyOptimizer`).

The trainable parameters of one dtype and device (a *kind*), in param-group order, are laid
end to end in a flat space of ``T`` elements (nothing is allocated for it). The space is cut
into buckets of ``B`` elements (``B`` a multiple of the group size ``N``), the last one
shorter; each bucket is split among the ranks by ``reduce_scatter``'s rule
(:func:`commlib.primitives.block_sizes`), so every full bucket gives each rank ``B / N``
elements and the last bucket gives the first ``L % N`` ranks one more: rank ``r`` owns
``floor(T / N)`` or ``ceil(T / N)`` elements, split inside parameters where the bucket
boundaries fall. Its owned elements, in flat order, form its *local flat* buffer; the
elements of one param group are a contiguous slice of it (the groups are contiguous in the
flat space), the shard the local optimizer steps.

Per bucket, gradients are reduce-scattered (``(N-1)/N * B`` bus bytes); the updated values
travel as each rank's whole local flat (one all-gather per kind, or per segment of at most
a cap, :func:`gather_segments`), padded to the largest local flat (``ceil(T / N)``
elements): allreduce's ``2 (N-1)/N * T`` in all.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..primitives import block_offsets, block_sizes


@dataclass
class Piece:
    """Elements ``[p_lo, p_lo + n)`` of the flattened ``param`` sit at ``at`` of a buffer."""
    param: torch.Tensor
    p_lo: int
    n: int
    at: int


@dataclass
class Bucket:
    """Elements ``[start, start + length)`` of a kind's flat space."""
    index: int
    start: int
    length: int
    sizes: list[int]      # elements each rank owns
    offsets: list[int]    # where each rank's part starts in the bucket
    pieces: list[Piece] = field(default_factory=list)   # ``at``: offset in the bucket
    local_at: list[int] = field(default_factory=list)   # each rank's part in its local flat


class Kind:
    """The flat space of the trainable parameters of one dtype and device."""

    def __init__(self, params: list[tuple[int, torch.Tensor]], shards: int,
                 bucket_elems: int) -> None:
        """``params``: (global group index, parameter) in flat order."""
        first = params[0][1]
        self.dtype, self.device = first.dtype, first.device
        self.params = [p for _, p in params]
        self.offset: dict[int, int] = {}
        self.segments: dict[int, tuple[int, int]] = {}   # group -> [lo, hi) of the space
        at = 0
        for g, p in params:
            self.offset[id(p)] = at
            lo, _ = self.segments.get(g, (at, at))
            at += p.numel()
            self.segments[g] = (lo, at)
        self.numel = at
        self.shards = shards
        size = max(shards, bucket_elems // shards * shards)
        self.buckets: list[Bucket] = []
        local = [0] * shards
        for i, start in enumerate(range(0, self.numel, size)):
            length = min(size, self.numel - start)
            b = Bucket(i, start, length, block_sizes(length, shards),
                       block_offsets(length, shards))
            b.pieces = self.pieces(start, length, 0)
            b.local_at = list(local)
            for r in range(shards):
                local[r] += b.sizes[r]
            self.buckets.append(b)
        self.local_numel = local   # elements each rank owns
        self.buckets_of: dict[int, list[int]] = {id(p): [] for p in self.params}
        for b in self.buckets:
            for piece in b.pieces:
                self.buckets_of[id(piece.param)].append(b.index)

    def pieces(self, lo: int, n: int, at: int) -> list[Piece]:
        """The parameter slices of flat elements ``[lo, lo + n)``, placed from ``at`` on."""
        out, hi = [], lo + n
        for p in self.params:
            p0 = self.offset[id(p)]
            a, b = max(lo, p0), min(hi, p0 + p.numel())
            if a < b:
                out.append(Piece(p, a - p0, b - a, at + a - lo))
        return out

    def owned(self, rank: int) -> list[tuple[int, int, int]]:
        """``rank``'s owned ranges: (flat start, elements, start in its local flat)."""
        return [(b.start + b.offsets[rank], b.sizes[rank], b.local_at[rank])
                for b in self.buckets if b.sizes[rank]]

    def local_pieces(self, rank: int) -> list[Piece]:
        """Parameter slices of ``rank``'s local flat (``at``: offset in it)."""
        return [piece for lo, n, at in self.owned(rank) for piece in self.pieces(lo, n, at)]

    def span(self, rank: int, group: int) -> tuple[int, int]:
        """[lo, hi) of ``rank``'s local flat holding param group ``group``'s elements
        (empty when it owns none of them)."""
        if group not in self.segments:
            return (0, 0)
        g_lo, g_hi = self.segments[group]
        lo = hi = None
        for f, n, at in self.owned(rank):
            a, b = max(f, g_lo), min(f + n, g_hi)
            if a < b:
                lo = at + a - f if lo is None else lo
                hi = at + b - f
        return (lo, hi) if lo is not None else (0, 0)

    def segment_pieces(self, rank: int, group: int) -> list[tuple[int, int, int]]:
        """(start in the group's segment, elements, start in ``rank``'s shard of the group)
        for each of ``rank``'s owned ranges inside param group ``group``'s segment."""
        g_lo, g_hi = self.segments[group]
        s_lo = self.span(rank, group)[0]
        out = []
        for f, n, at in self.owned(rank):
            a, b = max(f, g_lo), min(f + n, g_hi)
            if a < b:
                out.append((a - g_lo, b - a, at + a - f - s_lo))
        return out


def clip(pieces: list[Piece], lo: int, hi: int) -> list[Piece]:
    """The parts of ``pieces`` that sit in ``[lo, hi)`` of their buffer, placed from 0 on
    (``at`` shifted by ``-lo``)."""
    out = []
    for p in pieces:
        a, b = max(lo, p.at), min(hi, p.at + p.n)
        if a < b:
            out.append(Piece(p.param, p.p_lo + a - p.at, b - a, a - lo))
    return out


def gather_segments(kind: Kind, cap_elems: int) -> list[tuple[int, int]]:
    """``(lo, width)`` of the all-gathers of updated values: every rank sends
    ``[lo, lo + width)`` of its local flat (zero-padded past its end), ``width`` at most
    ``cap_elems``; together they cover the largest local flat."""
    widest, step = max(kind.local_numel), max(1, cap_elems)
    return [(lo, min(step, widest - lo)) for lo in range(0, widest, step)]


def plan(groups: list[list[torch.Tensor]], shards: int, bucket_bytes: int) -> list[Kind]:
    """The kinds of the trainable parameters of ``groups`` (lists of parameters), in order
    of first appearance (the same on every rank for the same parameters)."""
    by_kind: dict[tuple[str, str], list[tuple[int, torch.Tensor]]] = {}
    for g, params in enumerate(groups):
        for p in params:
            if p.requires_grad:
                by_kind.setdefault((str(p.dtype), str(p.device)), []).append((g, p))
    return [Kind(members, shards, max(1, bucket_bytes // members[0][1].element_size()))
            for members in by_kind.values()]


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened, sharing its memory (parameters and gradients are contiguous)."""
    return t.detach().view(-1)


def copy_out(pieces: list[Piece], src: torch.Tensor) -> None:
    """Parameters' slices from the flat buffer ``src`` (in place, no autograd)."""
    for piece in pieces:
        flat_view(piece.param)[piece.p_lo:piece.p_lo + piece.n].copy_(
            src[piece.at:piece.at + piece.n])


def copy_in(pieces: list[Piece], dst: torch.Tensor, grads: bool) -> None:
    """The flat buffer ``dst`` from the parameters' slices (``grads``: from their ``.grad``,
    zeros where it is ``None``)."""
    for piece in pieces:
        t = piece.param.grad if grads else piece.param
        part = dst[piece.at:piece.at + piece.n]
        if t is None:
            part.zero_()
        else:
            part.copy_(t.detach().reshape(-1)[piece.p_lo:piece.p_lo + piece.n])
