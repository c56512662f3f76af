"""``sparseloco``: SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky, 2025, arXiv 2508.15706):
DiLoCo's outer loop whose outer momentum is replaced by a per-replica error-feedback
buffer, and whose pseudo-gradients travel as a chunked top-k of 2-bit values.

.. not run: pseudocode of the algorithm's step

Every rank keeps the *global* weights ``g`` (the same on every rank), its own
error-feedback buffer ``e`` (different on every rank) and trains its replica ``x`` with
the user's (inner) optimizer for ``sync_every`` (H) iterations. Then, once every optimizer
of the H-th iteration stepped (before the next forward, or in ``average_parameters()``),
the outer step, the paper's Algorithm 1::

    delta  = g - x                                  # this rank's pseudo-gradient
    e      = error_decay * e + delta                # error feedback (beta)
    m_r    = Q(TopK(e))                             # chunked top-k, quantized: the message
    e      = e - decode(m_r)                        # what was not sent stays in e
    mean   = (1/R) sum_r decode(m_r)                # an allgather of the R messages
    g      = g - outer_lr * mean                    # plain SGD, no momentum
    x      = g                                      # every replica restarts from g

Nothing dense travels: one ``allgather`` of each bucket's message (indices, 2/4/8-bit
codes, per-chunk scales, packed into one uint8 buffer) per outer step. Every rank decodes
the same gathered bytes with the same operations in the same order (rank 0 first, one
rank's values added at a time, at distinct positions), so the mean, the global weights
and the replicas are bit-identical on every rank after each outer step.

**Chunks.** Each tensor of a bucket, flattened in row-major order, is cut into contiguous
chunks of ``chunk_size`` (C) elements, the last chunk of each tensor shorter (a chunk
never spans two tensors). A chunk of ``n_c`` elements sends its
``k_c = min(n_c, max(1, ceil(density * n_c)))`` elements of largest magnitude (``ceil``
computed in float64 with a 1e-9 slack, so that ``density * n_c`` equal to an integer up
to rounding gives that integer). Ties in magnitude: the element of lower index in the
chunk wins (a stable sort), so the selection is deterministic and reproducible.

**Quantizer** (``value_bits`` = b in 2, 4, 8; L = 2**(b-1) magnitude levels). Per chunk,
two float32 scales: ``lo`` and ``hi``, the smallest and the largest magnitude among the
chunk's selected values (rounded to float32). Each selected value ``v`` is sent as a sign
bit and a level ``q = clamp(round((|v| - lo) / s), 0, L - 1)`` with
``s = (hi - lo) / (L - 1)`` (``q = 0`` where ``s = 0``); the code is ``q + L * (v < 0)``.
Decoded: ``+-(lo + q * s)``, computed in the global weights' dtype from the float32
scales. So 2 bits give the four levels ``+-lo, +-hi``; 8 bits 128 magnitudes per sign.

.. not run: a formula, not code

**Message of a bucket and bytes per outer step.** With N_b chunks, K_b = sum of their
k_c, index width ``w = max(1, bit_length(C - 1))`` bits (12 for C = 4096)::

    M_b = 8 * N_b + ceil(K_b * w / 8) + ceil(K_b * b / 8)     bytes

laid out as [N_b (lo, hi) float32 pairs][K_b indices, w bits each][K_b codes, b bits
each], bit streams little-endian (bit i of value j at bit position j * width + i), chunks
in bucket order (tensors in bucket order, chunks in order), each chunk's values in
decreasing magnitude. Per outer step every rank hands MPI ``sum_b M_b`` bytes in one
allgather per bucket: commlib counts ``bytes = sum_b M_b`` and ``bus_bytes = (n - 1) *
sum_b M_b`` at n ranks. With C | n_t and the defaults (C = 4096, density 1/64, b = 2):
64 * (12 + 2) / 8 + 8 = 120 bytes per 4096 elements, 1/136.5 of the float32 weights;
against DiLoCo's float32 allreduce (``2 (n - 1) / n * 4`` bus bytes per element) that is
``n / 273`` of its bus bytes: 1/136 at 2 ranks, 1/68 at 4; an allgather grows with the
number of ranks (so does the paper's): it exceeds 1/30 from n = 10 on.

**Where this differs from the published code** (the reference read here is the CCLoco
code of the same group, github tplr-y/CCLoco ``src/tplr/ccloco.py``, whose
``ChunkingTransform`` and ``TopKCompressor`` SparseLoCo's ``src/tplr/sparseloco.py`` has
too, by that repository's public description; the SparseLoCo repository itself could
not be fetched here):

* chunks: the code tiles a 2-D tensor into blocks of (largest divisor of the rows <= 64)
  x (largest divisor of the columns <= 64) and a 1-D tensor into runs of the largest
  divisor of its length <= 64, with the same k in every chunk. Here: contiguous runs of C
  elements of the flattened tensor, k proportional to the chunk's size. Why: buckets are
  flat; any shape works (the divisor rule falls back to 1-element chunks, i.e. dense, for
  a prime dimension) and the bytes are the closed formula above. The code's own sweeps
  compare chunk shapes (square, each row, each column).
* indices: the code sends int64 indices (templar's production code a variable-length
  row codec); here ``w`` bits each, bit-packed (12 bits for 4096-element chunks).
* quantizer: the code's is statistical, per tensor: values centred on their mean, binned
  uniformly over ``range`` standard deviations in 2**b bins and decoded through a
  float32 lookup table of each bin's mean value, sent with the codes. Here: per chunk,
  sign + magnitude between the chunk's smallest and largest selected magnitude, two
  float32 scales per chunk. Why: top-k values all have magnitudes >= the chunk's
  threshold, so no level is spent near zero; per-chunk scales as the issue asks; a lookup
  table of 2**b float32 per chunk would outweigh the codes at 4 and 8 bits.
* aggregation: the code's ``scatter_reduce(reduce="mean", include_self=False)`` averages
  an index over the replicas that sent it; here, as the paper's Algorithm 1 writes it,
  ``(1/R) sum_r`` over all R replicas (an index one replica sent counts 1/R of it).
* outer learning rate: the code adds ``lr * delta`` to the error buffer and then steps
  ``-lr * aggregate``; the paper (and this) ``e = beta e + delta``, ``g -= alpha * mean``:
  the same at the paper's ``alpha = 1``.
* ties in top-k: ``torch.topk`` leaves them unspecified; here the lower index wins.

Defaults, from the paper (1-3% density, 2 bits, H = 15) and the CCLoco sweep
configurations (error decay 0.95, outer lr 1, 64 x 64 chunks, 15 inner steps): H = 15,
density 1/64 (64 of a 4096-element chunk, 1.56%), chunk_size 4096, value_bits 2,
error_decay 0.95, outer_lr 1.

State (:meth:`state_dict`): the global weights (the same on every rank) and this rank's
error-feedback buffers (``per_rank_state``); resumed bit-exact. Global weights and error
buffers of float16/bfloat16 parameters are float32. Non-finite values: when a rank's
error-fed pseudo-gradient of a bucket holds NaN or Inf it sends NaN scales for that
bucket; every rank then finds them in the gathered bytes and raises
:class:`~commlib.base.errors.NonFiniteError` naming those ranks, with nothing applied (global
weights, replicas and error buffers as before the outer step).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any

import torch

from ..base.errors import NonFiniteError
from ..primitives import allgather
from ..primitives.finite import all_finite
from . import state
from .base import Context
from .buckets import Bucket
from .diloco import DiLoCo
from .registry import register

VALUE_BITS = (2, 4, 8)


def values_per_chunk(length: int, density: float) -> int:
    """``k`` for a chunk of ``length`` elements: ``min(length, max(1, ceil(density *
    length)))`` (ceil with a 1e-9 slack)."""
    return min(length, max(1, math.ceil(density * length - 1e-9)))


def index_bits(chunk_size: int) -> int:
    """Bits per index within a chunk: ``max(1, bit_length(chunk_size - 1))``."""
    return max(1, (int(chunk_size) - 1).bit_length())


@dataclass(frozen=True)
class Segment:
    """``rows`` chunks of ``length`` elements each, contiguous from ``start`` in a bucket's
    flat buffer, ``k`` values sent per chunk; ``chunk0``/``value0``: the segment's first
    chunk and first value in the bucket's message."""

    start: int
    rows: int
    length: int
    k: int
    chunk0: int
    value0: int


@dataclass(frozen=True)
class Layout:
    """The message of one bucket: its segments, ``chunks`` (N_b), ``values`` (K_b) and the
    section sizes in bytes."""

    segments: tuple[Segment, ...]
    chunks: int
    values: int
    index_width: int
    value_bits: int

    @property
    def scale_bytes(self) -> int:
        return 8 * self.chunks

    @property
    def index_bytes(self) -> int:
        return (self.values * self.index_width + 7) // 8

    @property
    def code_bytes(self) -> int:
        return (self.values * self.value_bits + 7) // 8

    @property
    def nbytes(self) -> int:
        """``M_b = 8 N_b + ceil(K_b w / 8) + ceil(K_b b / 8)``."""
        return self.scale_bytes + self.index_bytes + self.code_bytes


def layout(numels: Sequence[int], chunk_size: int, density: float,
           value_bits: int) -> Layout:
    """The message layout of a bucket whose tensors have ``numels`` elements (in bucket
    order, contiguous in its flat buffer)."""
    segments, start, chunk0, value0 = [], 0, 0, 0
    for numel in numels:
        full, tail = divmod(int(numel), chunk_size)
        for rows, length in ((full, chunk_size), (1 if tail else 0, tail)):
            if rows:
                k = values_per_chunk(length, density)
                segments.append(Segment(start, rows, length, k, chunk0, value0))
                start, chunk0, value0 = start + rows * length, chunk0 + rows, value0 + rows * k
    return Layout(tuple(segments), chunk0, value0, index_bits(chunk_size), value_bits)


def top_positions(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of ``mag`` (rows, n; no NaN), the positions of its ``k`` largest values in
    decreasing order, a tie going to the lower position: the first ``k`` columns of a
    stable descending sort, without sorting the rows. ``torch.topk`` picks each row's
    ``k``; where it left out a value equal to the k-th (so that its choice among ties
    mattered), that row's ties at the k-th value are taken from the left instead; then
    only the ``k`` chosen are sorted: (rows, k) int64."""
    if k >= mag.shape[1]:
        return torch.sort(mag, dim=1, descending=True, stable=True).indices
    values, pos = torch.topk(mag, k, dim=1, sorted=False)
    kth = values.min(dim=1, keepdim=True).values
    at = mag == kth
    ambiguous = at.view(torch.uint8).sum(dim=1, dtype=torch.int32) > \
        (values == kth).view(torch.uint8).sum(dim=1, dtype=torch.int32)
    pos = pos.sort(dim=1).values                        # increasing in each row
    if bool(ambiguous.any()):
        rows = ambiguous.nonzero()[:, 0]
        m, a = mag[rows], at[rows]
        room = k - (m > kth[rows]).sum(dim=1, keepdim=True)
        chosen = (m > kth[rows]) | (a & (a.cumsum(dim=1) <= room))   # exactly k per row
        pos[rows] = chosen.nonzero()[:, 1].view(rows.numel(), k)
    order = torch.sort(mag.gather(1, pos), dim=1, descending=True, stable=True).indices
    return pos.gather(1, order)


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers ``codes`` (< 2**width) as a little-endian bit stream: a new
    uint8 tensor of ``ceil(numel * width / 8)`` bytes on ``codes``' device."""
    device = codes.device
    bits = (codes.reshape(-1, 1).to(torch.int64) >> torch.arange(width, device=device)) & 1
    nbytes = (bits.numel() + 7) // 8
    padded = torch.zeros(nbytes * 8, dtype=torch.int64, device=device)
    padded[:bits.numel()] = bits.reshape(-1)
    weights = torch.arange(8, device=device)
    return (padded.view(nbytes, 8) << weights).sum(1).to(torch.uint8)


def unpack_bits(buf: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``count`` int64 values of ``width`` bits."""
    device = buf.device
    bits = (buf.to(torch.int64).reshape(-1, 1) >> torch.arange(8, device=device)) & 1
    bits = bits.reshape(-1)[:count * width].view(count, width)
    return (bits << torch.arange(width, device=device)).sum(1)


@register("sparseloco")
class SparseLoCo(DiLoCo):
    """``sync_every`` (H): inner iterations between outer steps. ``density``: fraction of
    each chunk sent (in (0, 1]). ``chunk_size``: elements per chunk (>= 1).
    ``value_bits``: bits per sent value (2, 4 or 8). ``error_decay`` (beta, in [0, 1]):
    the error-feedback buffer's decay (0 turns error feedback off: what is not sent is
    dropped). ``outer_lr`` (alpha > 0): the outer SGD's step on the mean message. The
    inner optimizer is whatever optimizer the user steps. See the module docstring for
    the rule, the wire format and the bytes per outer step."""

    per_rank_state = True

    def __init__(self, sync_every: int = 15, density: float = 1 / 64, chunk_size: int = 4096,
                 value_bits: int = 2, error_decay: float = 0.95,
                 outer_lr: float = 1.0) -> None:
        name = type(self).name
        for arg, value in (("density", density), ("error_decay", error_decay),
                           ("outer_lr", outer_lr)):
            if isinstance(value, bool) or not isinstance(value, Real):
                raise TypeError(f"{name}: {arg} must be a real number, got {value!r}")
        for arg, value in (("chunk_size", chunk_size), ("value_bits", value_bits),
                           ("sync_every", sync_every)):
            if isinstance(value, bool) or not isinstance(value, Real):
                raise TypeError(f"{name}: {arg} must be an integer, got {value!r}")
        super().__init__(sync_every, outer_lr, outer_momentum=0.0, outer_nesterov=False)
        if not 0 < density <= 1:
            raise ValueError(f"{name}: density must be in (0, 1], got {density!r}")
        if int(chunk_size) != chunk_size or not 1 <= chunk_size <= 1 << 31:
            raise ValueError(f"{name}: chunk_size must be an integer in [1, 2**31], got "
                             f"{chunk_size!r}")
        if value_bits not in VALUE_BITS or int(value_bits) != value_bits:
            raise ValueError(f"{name}: value_bits must be one of {VALUE_BITS}, got "
                             f"{value_bits!r}")
        if not 0 <= error_decay <= 1:
            raise ValueError(f"{name}: error_decay must be in [0, 1], got {error_decay!r}")
        if not math.isfinite(outer_lr):
            raise ValueError(f"{name}: outer_lr must be finite, got {outer_lr!r}")
        self.density = float(density)
        self.chunk_size = int(chunk_size)
        self.value_bits = int(value_bits)
        self.error_decay = float(error_decay)
        self._error: list[torch.Tensor] = []
        self._layouts: list[Layout] = []

    # -- buckets, global weights, error buffers -------------------------------------------
    def make_buckets(self, ctx: Context) -> list[Bucket]:
        """DiLoCo's buckets and global weights, plus this rank's error-feedback buffers
        (zeros, the global weights' dtype and shape) and each bucket's message layout."""
        buckets = super().make_buckets(ctx)
        if len(self._error) != len(buckets):
            self._error = [torch.zeros_like(g, requires_grad=False) for g in self._global]
        self._layouts = [layout(b.numels, self.chunk_size, self.density, self.value_bits)
                         for b in buckets]
        return buckets

    def message_bytes(self) -> list[int]:
        """``M_b`` of each bucket, buckets in index order: what this rank hands to each
        bucket's allgather per outer step (the same on every rank)."""
        return [lay.nbytes for lay in self._layouts]

    # -- the outer step -------------------------------------------------------------------
    def _sync(self, ctx: Context) -> None:
        buckets = ctx.buckets
        deltas = self.pseudo_gradients(buckets)
        fed, messages = [], []
        for b, delta in zip(buckets, deltas):
            e = torch.mul(self._error[b.index], self.error_decay)
            e.add_(delta)
            fed.append(e)
            messages.append(self.encode(e, self._layouts[b.index]))
        works = [allgather(m, group=ctx.group, async_op=True) if m.numel() else None
                 for m in messages]
        gathered = [w.wait() if w is not None else m.new_empty(ctx.world_size, 0)
                    for w, m in zip(works, messages)]
        self._check_scales(ctx, buckets, gathered)
        means = []
        for b, e, rows in zip(buckets, fed, gathered):
            total = torch.zeros_like(e)
            for r in range(ctx.world_size):
                self.decode(rows[r], self._layouts[b.index], total,
                            residual=e if r == ctx.rank else None)
            means.append(total.div_(ctx.world_size))
        self.outer_step(buckets, means)
        for b, e in zip(buckets, fed):
            self._error[b.index] = e
            self.write_weights(b, self._global[b.index])

    def encode(self, e: torch.Tensor, lay: Layout) -> torch.Tensor:
        """This rank's message for a bucket whose error-fed pseudo-gradient is ``e`` (flat,
        the global weights' dtype; only read): a new uint8 tensor of ``lay.nbytes`` bytes
        on ``e``'s device. A non-finite ``e`` gives NaN scales (and zero codes)."""
        device, levels = e.device, 1 << (self.value_bits - 1)
        scales = torch.empty(lay.chunks, 2, dtype=torch.float32, device=device)
        index = torch.empty(lay.values, dtype=torch.int64, device=device)
        codes = torch.empty(lay.values, dtype=torch.int64, device=device)
        if not all_finite(e):
            scales.fill_(float("nan"))
            index.zero_()
            codes.zero_()
        else:
            for s in lay.segments:
                x = e[s.start:s.start + s.rows * s.length].view(s.rows, s.length)
                pos = top_positions(x.abs(), s.k)
                v = x.gather(1, pos)
                mag = v.abs()
                sc = torch.stack([mag[:, s.k - 1], mag[:, 0]], dim=1).to(torch.float32)
                scales[s.chunk0:s.chunk0 + s.rows] = sc
                lo, step = self._levels(sc, e.dtype, levels)
                q = torch.where(step > 0, (mag - lo) / torch.where(step > 0, step, 1),
                                torch.zeros_like(mag))
                q = q.round_().clamp_(0, levels - 1).to(torch.int64)
                q += levels * (v < 0).to(torch.int64)
                span = slice(s.value0, s.value0 + s.rows * s.k)
                index[span] = pos.reshape(-1)
                codes[span] = q.reshape(-1)
        return torch.cat([scales.reshape(-1).view(torch.uint8),
                          pack_bits(index, lay.index_width),
                          pack_bits(codes, lay.value_bits)])

    @staticmethod
    def _levels(scales: torch.Tensor, dtype: torch.dtype,
                levels: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``lo`` and the level step ``(hi - lo) / (L - 1)`` per chunk, as ``(rows, 1)``
        columns in ``dtype``, from float32 ``(rows, 2)`` scales."""
        lo, hi = scales[:, :1].to(dtype), scales[:, 1:].to(dtype)
        return lo, (hi - lo) / (levels - 1)

    def decode(self, message: torch.Tensor, lay: Layout, out: torch.Tensor,
               residual: torch.Tensor | None = None) -> None:
        """Add the values of ``message`` (one rank's bytes of a bucket) into ``out`` (flat,
        the bucket's size and the global weights' dtype), in place, at distinct positions;
        with ``residual``, also subtract them from it in place (this rank's own message:
        what was sent leaves the error buffer)."""
        levels = 1 << (self.value_bits - 1)
        scales = message[:lay.scale_bytes].clone(memory_format=torch.contiguous_format).view(
            torch.float32).view(lay.chunks, 2)
        a = lay.scale_bytes
        index = unpack_bits(message[a:a + lay.index_bytes], lay.values, lay.index_width)
        a += lay.index_bytes
        codes = unpack_bits(message[a:a + lay.code_bytes], lay.values, lay.value_bits)
        for s in lay.segments:
            span = slice(s.value0, s.value0 + s.rows * s.k)
            pos = index[span].view(s.rows, s.k)
            code = codes[span].view(s.rows, s.k)
            lo, step = self._levels(scales[s.chunk0:s.chunk0 + s.rows], out.dtype, levels)
            mag = lo + (code % levels).to(out.dtype) * step
            vals = torch.where(code >= levels, -mag, mag)
            window = slice(s.start, s.start + s.rows * s.length)
            out[window].view(s.rows, s.length).scatter_add_(1, pos, vals)
            if residual is not None:
                residual[window].view(s.rows, s.length).scatter_add_(1, pos, -vals)

    def _check_scales(self, ctx: Context, buckets: Sequence[Bucket],
                      gathered: Sequence[torch.Tensor]) -> None:
        """Raise on every rank (all see the same bytes) when some rank sent non-finite
        scales, naming those ranks; nothing was applied yet."""
        ranks, bad = set(), []
        for b, rows in zip(buckets, gathered):
            n = self._layouts[b.index].scale_bytes
            scales = rows[:, :n].clone(memory_format=torch.contiguous_format).view(torch.float32)
            finite = torch.isfinite(scales).all(dim=1)
            if not bool(finite.all()):
                bad.append(b.index)
                ranks.update(int(r) for r in torch.nonzero(~finite).reshape(-1))
        if bad:
            raise NonFiniteError(
                f"{self.name} (rank {ctx.rank}): the weights of rank(s) {sorted(ranks)} are "
                f"not finite at iteration {ctx.step} (a step taken on non-finite "
                f"gradients?); the outer step was not applied (non-finite error-fed "
                f"pseudo-gradient in bucket(s) {bad})")

    # -- saving and resuming --------------------------------------------------------------
    def save_state(self, ctx: Context) -> dict[str, Any]:
        """DiLoCo's (global weights, the same on every rank; no outer momentum) and this
        rank's error-feedback buffers."""
        saved = super().save_state(ctx)
        saved["error"] = [e.detach() for e in self._error]
        return saved

    def reset_own_state(self) -> None:
        """A newcomer's error-feedback buffers start at zero (what the rank whose state it
        took has not sent yet stays that rank's)."""
        for e in self._error:
            e.zero_()

    def load_state(self, ctx: Context, saved: Mapping[str, Any], where: str) -> None:
        self.check_state(ctx, saved, where, keys=("error",))
        state.check_same(where, "the number of error-feedback buffers",
                         len(saved["error"]), len(self._error))
        for k, e in enumerate(self._error):
            state.check_tensor(where, f"the error-feedback buffer of bucket {k}",
                               saved["error"][k], e)
        self.restore(saved)
        for e, value in zip(self._error, saved["error"]):
            state.copy_into(e, value)


__all__ = ["SparseLoCo", "Layout", "Segment", "layout", "pack_bits", "unpack_bits", "top_positions",
           "values_per_chunk", "index_bits"]
