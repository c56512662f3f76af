"""``powersgd``: rank-r gradient compression with error feedback (Vogels et al., 2019,
arXiv 1905.13727), with the semantics of torch's
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` (``PowerSGDState``): on the
same buckets (same tensors in the same order) both give the same gradients.

For ``start_iter`` iterations each bucket is averaged uncompressed (divided by the group
size, then summed, as torch's hook does). From then on, per bucket, with ``M_i`` the
gradient of tensor ``i`` viewed as ``(shape[0], -1)`` and ``r_i = min(rows, cols, rank)``:

1. with ``error_feedback``, the bucket's residual from the last step is added to it;
2. a tensor is compressed iff ``(rows + cols) * r_i * min_compression_rate < rows * cols``
   (so vectors never are); the others (biases, small matrices) are concatenated and
   averaged uncompressed;
3. ``Q_i`` (``cols x r_i``): the last step's (``warm_start``) or standard normal from a
   generator seeded with ``numpy.random.RandomState(random_seed).randint(10**9)`` (one draw
   per bucket each time Q is drawn, the same on every rank); orthogonalized
   (Gram-Schmidt for ``r <= 2`` or half precision, else QR; ``orthogonalization_epsilon``);
4. ``P_i = M_i Q_i``, summed over the ranks, orthogonalized; ``Q_i = M_i^T P_i``,
   averaged; ``M_i = P_i Q_i^T``;
5. the residual becomes the input of 1. minus the result (for uncompressed tensors too,
   as torch keeps it).

Per bucket and step this moves ``sum_i (rows_i + cols_i) r_i`` elements of the compressed
tensors plus the uncompressed ones, in three allreduces (uncompressed, P, Q).

Non-finite gradients: a NaN or Inf on any rank reaches every rank's result (everything is
summed); the step's residuals, P and Q memories and random draws are staged and kept only
when every bucket's result is finite (the same decision on every rank), otherwise every
gradient is set to NaN on every rank (``torch.amp.GradScaler`` then skips the step
everywhere) and the next step is exactly what it would have been without the bad one.
Under AMP the residual is in the units of the scaled loss; pass ``grad_scaler=`` (the
``torch.amp.GradScaler``, or a callable returning the scale) to keep it unscaled across
scale changes (``None``: torch's behaviour, residuals as they were scaled).

State (:meth:`state_dict`): per bucket the residual and the P and Q memories, and the
random generator's state; per rank (residuals differ).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..base.reduce_ops import ReduceOp
from ..primitives import allreduce
from ..primitives.finite import all_finite
from . import state
from .base import Algorithm, Context
from .buckets import Bucket
from .registry import register


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Orthonormalize the columns of each matrix of the batch ``(b, n, r)``, ``r <= n``, in
    place: Gram-Schmidt for ``r <= 2`` and half precision, QR otherwise (torch's rule)."""
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            col = matrices[:, :, i:i + 1]
            if epsilon == 0:
                col /= torch.norm(col, dim=1, keepdim=True)
            else:
                col /= torch.norm(col, dim=1, keepdim=True) + epsilon
            if i + 1 < rank:
                rest = matrices[:, :, i + 1:]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        torch.linalg.qr(matrices, out=(matrices, torch.empty(
            matrices.shape[0], rank, rank, device=matrices.device, dtype=matrices.dtype)))


def should_compress(rows: int, cols: int, rank: int, min_rate: float) -> bool:
    return (rows + cols) * rank * min_rate < rows * cols


class _Staged:
    """One bucket's updates of a compressed step, kept only if every result is finite."""

    __slots__ = ("error", "p", "q")

    def __init__(self, error: torch.Tensor | None, p: torch.Tensor, q: torch.Tensor) -> None:
        self.error, self.p, self.q = error, p, q


@register("powersgd")
class PowerSGD(Algorithm):
    """``rank``: the approximation rank (torch's ``matrix_approximation_rank``).
    ``start_iter``: uncompressed iterations first (``start_powerSGD_iter``; at least 2
    with error feedback or warm start, as torch requires). ``min_compression_rate``,
    ``error_feedback`` (``use_error_feedback``), ``warm_start``,
    ``orthogonalization_epsilon``, ``random_seed``, ``batch_tensors_with_same_shape``:
    torch's. ``grad_scaler``: see the module docstring."""

    per_rank_state = True

    def __init__(self, rank: int = 1, start_iter: int = 1000, min_compression_rate: float = 2,
                 error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, random_seed: int = 0,
                 batch_tensors_with_same_shape: bool = False,
                 grad_scaler: Any = None) -> None:
        if isinstance(rank, bool) or int(rank) != rank or rank < 1:
            raise ValueError(f"powersgd: rank must be an integer >= 1, got {rank!r}")
        if int(start_iter) != start_iter or start_iter < 0:
            raise ValueError(f"powersgd: start_iter must be an integer >= 0, got "
                             f"{start_iter!r}")
        if (error_feedback or warm_start) and start_iter <= 1:
            raise ValueError("powersgd: expect start_iter > 1 if error_feedback or warm_start "
                             "is enabled (as torch's PowerSGDState), because PowerSGD can "
                             f"only be applied after the first two iterations; got {start_iter}")
        if not min_compression_rate >= 0:
            raise ValueError(f"powersgd: min_compression_rate must be >= 0, got "
                             f"{min_compression_rate!r}")
        if grad_scaler is not None and not (callable(grad_scaler) or
                                            hasattr(grad_scaler, "get_scale")):
            raise TypeError(f"powersgd: grad_scaler must be a torch.amp.GradScaler or a "
                            f"callable returning the scale, got {type(grad_scaler).__name__}")
        self.rank = int(rank)
        self.start_iter = int(start_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.error_feedback = bool(error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.random_seed = int(random_seed)
        self.batch_tensors_with_same_shape = bool(batch_tensors_with_same_shape)
        self._scaler = grad_scaler
        self._rng = np.random.RandomState(self.random_seed)
        self._rng_at_start: Any = None     # the generator's state before this iteration
        self._error: dict[int, torch.Tensor] = {}
        self._p: dict[int, torch.Tensor] = {}
        self._q: dict[int, torch.Tensor] = {}
        self._staged: dict[int, _Staged] = {}

    def make_buckets(self, ctx: Context) -> list[Bucket]:
        buckets = super().make_buckets(ctx)
        self._error, self._p, self._q, self._staged = {}, {}, {}, {}
        return buckets

    # -- the exchange (communication thread) -------------------------------------------
    def on_bucket_ready(self, ctx: Context, bucket: Bucket) -> Any:
        flat = bucket.flat
        if ctx.step < self.start_iter:
            flat.div_(ctx.world_size)   # torch's allreduce hook divides first
            return allreduce(flat, op=ReduceOp.SUM, group=ctx.group, async_op=True)
        if bucket.index == 0:
            self._rng_at_start = self._rng.get_state()
        with torch.no_grad():
            self._compress(ctx, bucket)
        return None

    def _scale(self) -> float:
        if self._scaler is None:
            return 1.0
        scale = self._scaler() if callable(self._scaler) else self._scaler.get_scale()
        return float(scale)

    def _compress(self, ctx: Context, bucket: Bucket) -> None:
        n, k, flat = ctx.world_size, bucket.index, bucket.flat
        scale = self._scale()
        before = None
        if self.error_feedback:
            if k in self._error:
                if scale == 1.0:
                    flat.add_(self._error[k])
                else:
                    flat.add_(self._error[k], alpha=scale)
            before = flat.detach().clone()
        compress, uncompressed = [], []
        p_size = q_size = 0
        for view in bucket.views:
            if view.dim() == 0:
                uncompressed.append(view)
                continue
            matrix = view.view(view.shape[0], -1)
            rows, cols = matrix.shape
            r = min(rows, cols, self.rank)
            if should_compress(rows, cols, r, self.min_compression_rate):
                compress.append(matrix)
                p_size += rows * r
                q_size += cols * r
            else:
                uncompressed.append(view)
        memory = (torch.cat([t.reshape(-1) for t in uncompressed]) if uncompressed
                  else flat.new_empty(0))
        randomize = not self.warm_start or k not in self._p
        if randomize:
            p_mem = flat.new_empty(p_size)
            q_mem = flat.new_empty(q_size)
        else:   # staged copies: the memories change only if the step is kept
            p_mem, q_mem = self._p[k].clone(), self._q[k].clone()
        by_shape: dict[torch.Size, list[torch.Tensor]] = defaultdict(list)
        for matrix in compress:
            by_shape[matrix.shape].append(matrix)
        batches = []
        for group in by_shape.values():
            if self.batch_tensors_with_same_shape:
                batches.append(group[0].unsqueeze(0) if len(group) == 1 else torch.stack(group))
            else:
                batches.extend(m.unsqueeze(0) for m in group)
        ps, qs = [], []
        p_at = q_at = 0
        for batch in batches:
            b, rows, cols = batch.shape
            r = min(rows, cols, self.rank)
            ps.append(p_mem[p_at:p_at + b * rows * r].view(b, rows, r))
            qs.append(q_mem[q_at:q_at + b * cols * r].view(b, cols, r))
            p_at += b * rows * r
            q_at += b * cols * r
        if randomize:
            generator = torch.Generator().manual_seed(int(self._rng.randint(1_000_000_000)))
            for q in qs:
                q.copy_(torch.randn(*q.shape, generator=generator, dtype=q.dtype))
                orthogonalize(q, self.orthogonalization_epsilon)
        else:
            for q in qs:
                orthogonalize(q, self.orthogonalization_epsilon)
        for batch, q, p in zip(batches, qs, ps):
            torch.bmm(batch, q, out=p)
        if memory.numel():
            self.exchange(ctx, "uncompressed", memory)
            memory.div_(n)
            offset = 0
            for t in uncompressed:
                t.copy_(memory[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        if p_mem.numel():
            self.exchange(ctx, "p", p_mem)
        for p in ps:
            orthogonalize(p, self.orthogonalization_epsilon)
        for batch, p, q in zip(batches, ps, qs):
            torch.bmm(batch.transpose(1, 2), p, out=q)
        if q_mem.numel():
            self.exchange(ctx, "q", q_mem)
            q_mem.div_(n)
        for p, q, batch in zip(ps, qs, batches):
            torch.bmm(p, q.transpose(1, 2), out=batch)
        if self.batch_tensors_with_same_shape:
            for batch in batches:
                if batch.shape[0] > 1:
                    for i, original in enumerate(by_shape[batch.shape[1:]]):
                        original.copy_(batch[i])
        error = None
        if before is not None:
            error = before - flat if scale == 1.0 else (before - flat).div_(scale)
        self._staged[k] = _Staged(error, p_mem, q_mem)

    def exchange(self, ctx: Context, what: str, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` (``what``: ``"uncompressed"``, ``"p"`` or ``"q"``) over the group,
        in place."""
        allreduce(tensor, op=ReduceOp.SUM, group=ctx.group)

    def after_backward(self, ctx: Context) -> None:
        """Keep the step's residuals and memories if every bucket's result is finite (the
        same on every rank); otherwise keep nothing and make every gradient NaN."""
        if not self._staged:
            return
        staged, self._staged = self._staged, {}
        finite = all(all_finite(b.flat) for b in ctx.buckets)
        if not finite:
            if self._rng_at_start is not None:
                self._rng.set_state(self._rng_at_start)
            for b in ctx.buckets:
                b.flat.fill_(float("nan"))
            return
        for k, s in staged.items():
            if s.error is not None:
                self._error[k] = s.error
            if self.warm_start:
                self._p[k], self._q[k] = s.p, s.q
        self._rng_at_start = None

    # -- saving and resuming -----------------------------------------------------------
    def save_state(self, ctx: Context) -> dict[str, Any]:
        """Per bucket (``None`` where not made yet) the residual and the warm-start P and
        Q memories; the random generator's state."""
        if self._staged:
            raise RuntimeError(f"powersgd.state_dict (rank {ctx.rank}): a backward pass is "
                               f"in progress; take the state between iterations")
        _, keys, pos, has_gauss, gauss = self._rng.get_state()
        per = lambda d: [d.get(b.index) for b in ctx.buckets]  # noqa: E731
        return {"buckets": state.bucket_layout(ctx.buckets), "error": per(self._error),
                "p": per(self._p), "q": per(self._q),
                "rng": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "gauss": float(gauss)}}

    def load_state(self, ctx: Context, saved: Mapping[str, Any], where: str) -> None:
        state.check_keys(where, saved, ("buckets", "error", "p", "q", "rng"))
        state.check_layout(where, saved["buckets"], ctx.buckets)
        restored: dict[str, dict[int, torch.Tensor]] = {"error": {}, "p": {}, "q": {}}
        for key in restored:
            for b, value in zip(ctx.buckets, saved[key]):
                if value is None:
                    continue
                if key == "error":
                    state.check_tensor(where, f"the residual of bucket {b.index}", value,
                                       b.flat)
                elif not isinstance(value, torch.Tensor) or value.dim() != 1 or \
                        value.dtype != b.dtype:
                    raise ValueError(f"{where}: the {key.upper()} memory of bucket {b.index} "
                                     f"must be a 1-D {b.dtype} tensor")
                restored[key][b.index] = state.restore(value, b.flat.device)
        rng = saved["rng"]
        state.check_keys(f"{where}: rng", rng, ("keys", "pos", "has_gauss", "gauss"))
        state.check_tensor(where, "the random generator's keys", rng["keys"], (624,),
                           torch.int64)
        self._rng.set_state(("MT19937", rng["keys"].numpy().astype(np.uint32),
                             int(rng["pos"]), int(rng["has_gauss"]), float(rng["gauss"])))
        self._error, self._p, self._q = restored["error"], restored["p"], restored["q"]
        self._staged, self._rng_at_start = {}, None

