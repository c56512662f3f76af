"""``demo``: DeMo, Decoupled Momentum optimization (Peng, Quesnelle, Kingma, 2024, arXiv
2411.19870), following the authors' ``demo.py`` (github.com/bloc97/DeMo) step for step.
Gradients never travel: each rank keeps its own momentum and sends only a few DCT
coefficients of it.

.. not run: pseudocode of the algorithm's step

Per iteration, for every tensor (parameter) of every gradient bucket, on every rank::

    delta  = decay * delta + lr * grad              # local momentum (compression_decay)
    C      = DCT(chunks of delta)                   # orthonormal DCT-II per chunk
    idx, v = top-k of |C| in each chunk             # topk per chunk
    delta -= IDCT(scatter(idx, v))                  # error feedback: remove what is sent
    (idx_r, v_r) for every rank r = allgather(idx, v)
    M      = per coefficient, the mean of the v_r of the ranks that sent it (0 if none)
    grad   = sign(IDCT(M))                          # written into the gradient buffer

and the user's ``torch.optim.SGD(lr, momentum=0, weight_decay=wd)`` then applies
``p -= lr * (sign(...) + wd * p)``, which is the reference's
``p *= 1 - lr * wd; p -= lr * sign(...)`` (decoupled weight decay, the same in exact
arithmetic).

**Chunks** (as the reference's ``TransformDCT``): a dimension of size ``n`` is cut into
blocks of ``s = `` the largest divisor of ``n`` not above ``chunk_size`` (``s = 1`` for a
prime ``n > chunk_size``, as in the reference). A 1-D tensor of length ``L`` has ``L / s``
chunks of ``s`` coefficients (1-D DCT); a 2-D ``(R, C)`` tensor has ``(R / s1) (C / s2)``
chunks of ``s1 s2`` coefficients (the 2-D DCT of each ``s1 x s2`` block, coefficients
flattened row-major, as the reference's ``einsum`` + ``rearrange``). ``k = min(topk, s)``
(resp. ``s1 s2``) per chunk, at least 1. The DCT is a matmul with the orthonormal DCT-II
matrix of each block size, built once (float64, cast to the gradient dtype) and cached.

**Paired optimizer.** ``torch.optim.SGD`` with ``momentum=0`` (the update direction is
already a momentum's sign), any ``lr`` and ``weight_decay``; ``maximize=True`` is refused
(``ValueError`` at the first ``optimizer.step()``), any other optimizer, or SGD with
momentum or Nesterov, warns once (it runs, but it is not DeMo).

**Learning rate in the momentum.** The reference folds its learning rate into the momentum
(``delta = decay * delta + lr * grad``). ``lr=None`` (default) folds 1: the momentum is in
gradient units. Under a *constant* learning rate this changes nothing: the reference's
momentum is ``lr`` times ours at every step, and top-k selection, error feedback, the
mean over senders and the sign are all invariant under a common positive scale, so the
updates are the reference's. Under a schedule the reference weights each gradient by the
learning rate of its step; pass ``lr=`` a callable returning the learning rate that the
coming ``optimizer.step()`` will use (e.g. ``lambda: opt.param_groups[0]["lr"]``; read
during each backward, after the previous iteration's ``scheduler.step()``), or a float.
The reference reads each param group's own lr; here one value serves every tensor.

.. not run: a formula, not code

**Bytes per step.** One ``allgather`` per bucket of a uint8 buffer holding the bucket's
values (gradient dtype, ``e`` bytes each) then its indices (``w_t`` bytes each, little
endian, the smallest of 1, 2, 4 bytes that holds the chunk's largest index, ``s_t - 1``)::

    B_bucket = sum over its tensors t of  chunks_t * k_t * (e + w_t)   bytes sent per rank
    bus bytes per rank per step = (n - 1) * sum over buckets of B_bucket

(commlib's counters: ``bytes`` ``B``, ``bus_bytes`` ``(n - 1) B`` per allgather; see
:func:`bytes_per_step`). ``gradient_allreduce`` moves ``2 (n - 1) / n * G * e`` for ``G``
gradient elements, so the ratio is ``n * sum(chunks k (e + w)) / (2 G e)``: it grows with
``n``, as any allgather does. The reference sends int64 indices (``torch.topk``'s) in two
all-gathers per tensor; the narrow indices carry the same numbers in a quarter to an eighth
of the bytes, and one buffer per bucket makes one collective per bucket.

**Deviations from the reference** (each noted where it is done): tensors of more than two
dimensions (convolutions), which the reference's ``rearrange`` rejects, are chunked as the
matrix ``(shape[0], prod(shape[1:]))``; the mean over senders is computed as a sum in rank
order divided by the count (the reference's ``scatter_reduce(mean)`` is nondeterministic on
CUDA, its own comment says so); one ``lr`` for every tensor (above).

**Replicas.** Every rank decodes the same gathered bytes with the same operations in the
same order, so every rank writes bitwise the same update and replicas stay bitwise equal
(given the same initial weights and optimizer). Each rank's momentum is its own.

**Non-finite gradients** (as the other gradient algorithms): a rank whose bucket holds NaN
or Inf sends NaN values; every rank then sees them in the gathered bytes, and after
backward every gradient of every bucket is NaN on every rank (so ``torch.amp.GradScaler``,
or a finiteness check, skips the step everywhere) and no momentum changes: the run
continues exactly as if the step had not happened. Under AMP pass ``grad_scaler=`` (the
``GradScaler``, or a callable returning the scale): the momentum is then kept unscaled
(``grad / scale``) and the written update is ``sign * scale``, which the scaler's
``unscale_`` turns back into exactly ``sign`` (scales are powers of two). Without it the
momentum mixes scales and the applied step is ``lr * sign / scale``.

**State** (:meth:`state_dict`): the momentum of every bucket (``None`` before the first
step), per rank; resumed bit-exactly.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..primitives import allgather
from ..primitives.finite import all_finite
from . import state
from .base import Algorithm, Context
from .buckets import Bucket
from .registry import register


def smaller_split(n: int, target: int) -> int:
    """The largest divisor of ``n`` (>= 1) that is at most ``target`` (>= 1): the reference's
    ``_get_smaller_split``, the block size of a dimension of size ``n``."""
    best = 1
    for d in range(1, min(n, target) + 1):
        if n % d == 0:
            best = d
    return best


def dct_matrix(size: int, dtype: torch.dtype = torch.float64,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal DCT-II matrix ``D`` (``size x size``): ``D @ x`` is the DCT of ``x``
    (``scipy.fft.dct(x, norm="ortho")``), ``D.T @ X`` its inverse. Computed in float64,
    then cast. Entries that are zero in exact arithmetic (``cos(pi/2)``, e.g. the middle
    sample of odd frequencies for an odd size) are exactly 0: an update element that only
    such entries reach is then exactly 0 (its sign 0), not the sign of rounding noise."""
    k = torch.arange(size, dtype=torch.int64).unsqueeze(1)
    j = torch.arange(size, dtype=torch.int64).unsqueeze(0)
    m = ((2 * j + 1) * k) % (4 * size)                 # the angle is pi * m / (2 size)
    d = torch.cos(math.pi * m.to(torch.float64) / (2 * size)) * math.sqrt(2.0 / size)
    d[(m == size) | (m == 3 * size)] = 0.0
    d[0] = math.sqrt(1.0 / size)
    return d.to(dtype=dtype, device=device)


def index_width(coefficients: int) -> int:
    """Bytes per index for chunks of ``coefficients`` (indices ``0..coefficients - 1``)."""
    if coefficients <= 1 << 8:
        return 1
    if coefficients <= 1 << 16:
        return 2
    return 4


@dataclass(frozen=True)
class Layout:
    """How one tensor is chunked: ``blocks`` (``(s,)`` for 1-D, ``(s1, s2)`` for 2-D),
    ``grid`` (chunks along each dimension), ``coefficients`` per chunk (``prod(blocks)``),
    ``k`` sent per chunk, ``width`` bytes per index."""

    shape: tuple[int, ...]
    blocks: tuple[int, ...]
    grid: tuple[int, ...]
    k: int
    width: int

    @property
    def chunks(self) -> int:
        return math.prod(self.grid)

    @property
    def coefficients(self) -> int:
        return math.prod(self.blocks)

    @property
    def sent(self) -> int:
        """Coefficients this tensor sends per rank and step."""
        return self.chunks * self.k


def layout(shape: tuple[int, ...] | torch.Size, chunk_size: int, topk: int) -> Layout | None:
    """The chunking of a tensor of ``shape`` (``None`` when it is empty: nothing is sent).
    Scalars are 1-D of length 1; more than two dimensions: the matrix
    ``(shape[0], prod(shape[1:]))`` (the reference handles 1-D and 2-D only)."""
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if numel == 0:
        return None
    dims = (numel,) if len(shape) <= 1 else (shape[0], numel // shape[0])
    blocks = tuple(smaller_split(d, chunk_size) for d in dims)
    grid = tuple(d // b for d, b in zip(dims, blocks))
    coefficients = math.prod(blocks)
    return Layout(shape, blocks, grid, max(1, min(topk, coefficients)),
                  index_width(coefficients))


def bytes_per_step(shapes, chunk_size: int, topk: int, element_size: int) -> int:
    """Bytes each rank sends per step (``B``, summed over buckets) for gradients of
    ``shapes`` with ``element_size``-byte elements: ``sum chunks * k * (element_size +
    width)``. commlib counts ``(n - 1)`` times this as bus bytes."""
    total = 0
    for shape in shapes:
        lay = layout(shape, chunk_size, topk)
        if lay is not None:
            total += lay.sent * (element_size + lay.width)
    return total


class _Transform:
    """The chunked DCT of one dtype and device (matrices cached per block size)."""

    def __init__(self) -> None:
        self._cache: dict[tuple, torch.Tensor] = {}

    def matrix(self, size: int, like: torch.Tensor) -> torch.Tensor:
        key = (size, like.dtype, like.device)
        m = self._cache.get(key)
        if m is None:
            m = self._cache[key] = dct_matrix(size, like.dtype, like.device)
        return m

    def encode(self, x: torch.Tensor, lay: Layout) -> torch.Tensor:
        """``x`` (shaped ``lay.shape``) -> ``(chunks, coefficients)`` DCT coefficients."""
        if len(lay.blocks) == 1:
            d = self.matrix(lay.blocks[0], x)
            return x.reshape(lay.chunks, lay.blocks[0]) @ d.T
        (s1, s2), (g1, g2) = lay.blocks, lay.grid
        d1, d2 = self.matrix(s1, x), self.matrix(s2, x)
        blocks = x.reshape(g1, s1, g2, s2).permute(0, 2, 1, 3)      # (g1, g2, s1, s2)
        return (d1 @ blocks @ d2.T).reshape(lay.chunks, lay.coefficients)

    def decode(self, c: torch.Tensor, lay: Layout) -> torch.Tensor:
        """Inverse of :meth:`encode`: ``(chunks, coefficients)`` -> shaped ``lay.shape``."""
        if len(lay.blocks) == 1:
            return (c @ self.matrix(lay.blocks[0], c)).reshape(lay.shape)
        (s1, s2), (g1, g2) = lay.blocks, lay.grid
        d1, d2 = self.matrix(s1, c), self.matrix(s2, c)
        blocks = d1.T @ c.reshape(g1, g2, s1, s2) @ d2
        return blocks.permute(0, 2, 1, 3).reshape(lay.shape)


def _pack_indices(idx: torch.Tensor, width: int) -> torch.Tensor:
    """int64 indices -> ``width`` little-endian bytes each (uint8, flat)."""
    parts = [((idx >> (8 * i)) & 0xFF) for i in range(width)]
    return torch.stack(parts, dim=-1).to(torch.uint8).reshape(-1)


def _unpack_indices(raw: torch.Tensor, width: int) -> torch.Tensor:
    """``(..., m * width)`` uint8 -> ``(..., m)`` int64."""
    b = raw.reshape(*raw.shape[:-1], -1, width).to(torch.int64)
    idx = b[..., 0].clone()
    for i in range(1, width):
        idx |= b[..., i] << (8 * i)
    return idx


class _Plan:
    """A bucket's tensors' layouts and where each sits in the bucket's payload: values
    first (``value_at`` in elements), then indices (``index_at`` in bytes)."""

    def __init__(self, bucket: Bucket, chunk_size: int, topk: int) -> None:
        self.layouts = [layout(v.shape, chunk_size, topk) for v in bucket.views]
        self.element_size = bucket.flat.element_size()
        values = sum(lay.sent for lay in self.layouts if lay is not None)
        self.values_bytes = values * self.element_size
        self.value_at, self.index_at = [], []
        v_at, i_at = 0, self.values_bytes
        for lay in self.layouts:
            self.value_at.append(v_at)
            self.index_at.append(i_at)
            if lay is not None:
                v_at += lay.sent
                i_at += lay.sent * lay.width
        self.nbytes = i_at


@register("demo")
class DeMo(Algorithm):
    """DeMo (module docstring). ``chunk_size``: target DCT block size per dimension
    (reference ``compression_chunk``, 64). ``topk``: coefficients sent per chunk
    (``compression_topk``, 32). ``compression_decay``: the momentum's decay, in ``[0, 1)``
    (0.999, the paper's and the code's). ``lr``: the learning rate folded into the
    momentum: ``None`` (1: gradient units; the reference's updates under any constant
    learning rate), a float > 0, or a callable returning the coming step's learning rate
    (>= 0). ``grad_scaler``: the ``torch.amp.GradScaler`` (or a callable returning the
    scale) under AMP.

    Pair it with ``torch.optim.SGD(params, lr, momentum=0, weight_decay=...)``. After each
    backward every rank's ``.grad`` holds bitwise the same ``sign(decoded mean)`` (times
    the loss scale with ``grad_scaler``), in the gradients' dtype, written in place into
    the bucket buffers; every rank's momentum is its own."""

    per_rank_state = True

    def __init__(self, chunk_size: int = 64, topk: int = 32, compression_decay: float = 0.999,
                 lr: float | Callable[[], float] | None = None,
                 grad_scaler: Any = None) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"demo: chunk_size must be an integer >= 1, got {chunk_size!r}")
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ValueError(f"demo: topk must be an integer >= 1 (coefficients sent per "
                             f"chunk), got {topk!r}")
        if isinstance(compression_decay, bool) or \
                not isinstance(compression_decay, (int, float)) or \
                not 0.0 <= float(compression_decay) < 1.0:
            raise ValueError(f"demo: compression_decay must be a number in [0, 1), got "
                             f"{compression_decay!r}")
        if lr is not None and not callable(lr) and (
                isinstance(lr, bool) or not isinstance(lr, (int, float))
                or not (math.isfinite(lr) and lr > 0)):
            raise ValueError(f"demo: lr must be None, a finite number > 0 or a callable "
                             f"returning the learning rate, got {lr!r}")
        if grad_scaler is not None and not (callable(grad_scaler) or
                                            hasattr(grad_scaler, "get_scale")):
            raise TypeError(f"demo: grad_scaler must be a torch.amp.GradScaler or a callable "
                            f"returning the scale, got {type(grad_scaler).__name__}")
        self.chunk_size = int(chunk_size)
        self.topk = int(topk)
        self.compression_decay = float(compression_decay)
        self.lr = lr
        self._scaler = grad_scaler
        self._transform = _Transform()
        self._plans: list[_Plan] = []
        self._momentum: dict[int, torch.Tensor] = {}
        self._staged: dict[int, torch.Tensor | None] = {}   # bucket -> new momentum
        self._bad = False                                    # a non-finite bucket this step
        self._checked: set[int] = set()                      # optimizers already checked

    def make_buckets(self, ctx: Context) -> list[Bucket]:
        buckets = super().make_buckets(ctx)
        self._plans = [_Plan(b, self.chunk_size, self.topk) for b in buckets]
        self._momentum, self._staged, self._bad = {}, {}, False
        return buckets

    # -- the exchange (communication thread) -------------------------------------------
    def _lr_now(self) -> float:
        if self.lr is None:
            return 1.0
        value = float(self.lr() if callable(self.lr) else self.lr)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"demo: the learning rate folded into the momentum must be "
                             f"finite and >= 0, lr() returned {value!r}")
        return value

    def _scale(self) -> float:
        if self._scaler is None:
            return 1.0
        scale = self._scaler() if callable(self._scaler) else self._scaler.get_scale()
        return float(scale)

    def on_bucket_ready(self, ctx: Context, bucket: Bucket) -> None:
        with torch.no_grad():
            self._step_bucket(ctx, bucket)

    def _step_bucket(self, ctx: Context, bucket: Bucket) -> None:
        plan = self._plans[bucket.index]
        flat = bucket.flat
        finite = all_finite(flat)
        payload = torch.empty(plan.nbytes, dtype=torch.uint8, device=flat.device)
        values = payload[:plan.values_bytes].view(flat.dtype) if plan.values_bytes else None
        momentum = None
        if finite:
            lr, scale = self._lr_now(), self._scale()
            old = self._momentum.get(bucket.index)
            momentum = (old * self.compression_decay if old is not None
                        else torch.zeros_like(flat))
            momentum.add_(flat, alpha=lr / scale)
        for view, lay, v_at, i_at in zip(torch.split(momentum, bucket.numels)
                                         if momentum is not None else bucket.views,
                                         plan.layouts, plan.value_at, plan.index_at):
            if lay is None:
                continue
            if momentum is None:    # non-finite: NaN values (every rank will see them)
                values[v_at:v_at + lay.sent].fill_(float("nan"))
                idx = torch.arange(lay.k, device=flat.device).repeat(lay.chunks)
            else:
                coef = self._transform.encode(view, lay)
                idx = torch.topk(coef.abs(), lay.k, dim=-1, largest=True, sorted=False).indices
                val = torch.gather(coef, -1, idx)
                own = torch.zeros_like(coef).scatter_(-1, idx, val)
                self._remove_sent(view, self._transform.decode(own, lay).reshape(view.shape))
                values[v_at:v_at + lay.sent].copy_(val.reshape(-1))
            payload[i_at:i_at + lay.sent * lay.width] = _pack_indices(idx, lay.width)
        gathered = self.exchange(ctx, payload)
        ok = self._decode(bucket, plan, gathered)
        self._staged[bucket.index] = momentum if ok else None
        if not ok:
            self._bad = True
            flat.fill_(float("nan"))

    def _remove_sent(self, momentum: torch.Tensor, sent: torch.Tensor) -> None:
        """Error feedback: what this rank sends leaves its momentum (in place)."""
        momentum.sub_(sent)

    def exchange(self, ctx: Context, payload: torch.Tensor) -> torch.Tensor:
        """Every rank's payload (1-D uint8), ``(n, nbytes)`` in rank order."""
        return allgather(payload, group=ctx.group)

    def _decode(self, bucket: Bucket, plan: _Plan, gathered: torch.Tensor) -> bool:
        """Write ``sign(IDCT(mean over senders))`` (times the loss scale) into the bucket;
        ``False`` (nothing written) when a gathered value is not finite."""
        n = gathered.shape[0]
        dtype, device = bucket.flat.dtype, bucket.flat.device
        # a fresh copy: a row of the gathered bytes need not be aligned for ``dtype``
        raw = torch.empty((n, plan.values_bytes), dtype=torch.uint8, device=device)
        raw.copy_(gathered[:, :plan.values_bytes])
        values = raw.view(dtype)
        if not all_finite(values):
            return False
        scale = self._scale()
        for view, lay, v_at, i_at in zip(bucket.views, plan.layouts, plan.value_at,
                                         plan.index_at):
            if lay is None:
                continue
            val = values[:, v_at:v_at + lay.sent].reshape(n, lay.chunks, lay.k)
            idx = _unpack_indices(gathered[:, i_at:i_at + lay.sent * lay.width],
                                  lay.width).reshape(n, lay.chunks, lay.k)
            total = torch.zeros((lay.chunks, lay.coefficients), dtype=dtype, device=device)
            count = torch.zeros_like(total)
            ones = torch.ones((lay.chunks, lay.k), dtype=dtype, device=device)
            for r in range(n):   # rank order; a rank's indices are distinct in a chunk
                total.scatter_add_(-1, idx[r], val[r])
                count.scatter_add_(-1, idx[r], ones)
            mean = total / count.clamp_(min=1)
            update = self._transform.decode(mean, lay).sign_()
            if scale != 1.0:
                update.mul_(scale)
            view.copy_(update.reshape(view.shape))
        return True

    def after_backward(self, ctx: Context) -> None:
        """Keep the step's momenta if every bucket's gathered values were finite (the same
        on every rank); otherwise keep none and make every gradient NaN."""
        staged, self._staged = self._staged, {}
        bad, self._bad = self._bad, False
        if bad:
            for b in ctx.buckets:
                b.flat.fill_(float("nan"))
            return
        for k, momentum in staged.items():
            self._momentum[k] = momentum

    def before_optimizer_step(self, ctx: Context, optimizer: torch.optim.Optimizer) -> None:
        """Refuse ``maximize`` and warn (once per optimizer) about anything but plain SGD."""
        if id(optimizer) in self._checked:
            return
        groups = optimizer.param_groups
        if any(g.get("maximize", False) for g in groups):
            raise ValueError("demo: the optimizer has maximize=True; DeMo's update "
                             "(sign of the decoded momentum) must be descended: use "
                             "torch.optim.SGD(params, lr, momentum=0)")
        self._checked.add(id(optimizer))
        if not isinstance(optimizer, torch.optim.SGD):
            warnings.warn(f"demo: the gradients hold DeMo's update direction, meant for "
                          f"torch.optim.SGD(params, lr, momentum=0); "
                          f"{type(optimizer).__name__} transforms it further (not DeMo)",
                          UserWarning, stacklevel=2)
        elif any(g.get("momentum", 0) or g.get("nesterov", False) for g in groups):
            warnings.warn("demo: torch.optim.SGD with momentum adds a second momentum on "
                          "top of DeMo's (not DeMo); use momentum=0", UserWarning,
                          stacklevel=2)

    # -- saving and resuming -----------------------------------------------------------
    def save_state(self, ctx: Context) -> dict[str, Any]:
        """Per bucket the momentum (``None`` before the first step)."""
        if self._staged:
            raise RuntimeError(f"demo.state_dict (rank {ctx.rank}): a backward pass is in "
                               f"progress; take the state between iterations")
        return {"buckets": state.bucket_layout(ctx.buckets),
                "momentum": [self._momentum.get(b.index) for b in ctx.buckets]}

    def reset_own_state(self) -> None:
        """A newcomer starts without momentum (as before its first step): the momentum
        holds what the rank whose state it took has not sent yet."""
        self._momentum, self._staged, self._bad = {}, {}, False

    def load_state(self, ctx: Context, saved: Mapping[str, Any], where: str) -> None:
        state.check_keys(where, saved, ("buckets", "momentum"))
        state.check_layout(where, saved["buckets"], ctx.buckets)
        if not isinstance(saved["momentum"], (list, tuple)) or \
                len(saved["momentum"]) != len(ctx.buckets):
            raise ValueError(f"{where}: the momentum must be a list of one entry per bucket")
        restored = {}
        for b, value in zip(ctx.buckets, saved["momentum"]):
            if value is None:
                continue
            state.check_tensor(where, f"the momentum of bucket {b.index}", value, b.flat)
            restored[b.index] = state.restore(value, b.flat.device)
        self._momentum, self._staged, self._bad = restored, {}, False
