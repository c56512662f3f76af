"""``qadam``: Adam whose momentum, not gradient, is exchanged compressed after a warm-up.

For ``warmup_steps`` steps the algorithm averages gradients in full precision (as
``gradient_allreduce``) and :class:`QAdamOptimizer` is plain Adam. From then on the second
moment ``v`` is frozen, and in backward each bucket's momentum is updated locally,
``m <- beta1 m + (1 - beta1) (g + weight_decay p)``, and averaged over the ranks through
the compressed allreduce in its preconditioned form ``u = m / (sqrt(v_hat) + eps)``: 1-bit signs with per-chunk scales and error feedback
(``compression="sign1"``, about 1/32 of the bytes) or min-max uint8
(``compression="minmax_uint8"``, about 1/4). Every rank then sets
``m = avg(u) * (sqrt(v_hat) + eps)`` and the optimizer steps on it with the frozen variance:
``p <- p - lr * m_hat / (sqrt(v_hat) + eps)``. Gradients themselves no longer travel.

Non-finite gradients: a NaN or Inf on any rank travels as NaN chunks of ``u`` to every
rank (see :mod:`commlib.primitives.compressed`); the step's momentum updates and
error-feedback residuals are computed aside and kept only when every bucket's result is
finite, the same decision on every rank. Otherwise nothing is kept and every rank's
gradients are set to NaN, so ``torch.amp.GradScaler`` (or any finite check) skips the step
on every rank, and the next step is exactly what it would have been without the bad one.

Why ``u`` and not ``m``: the frozen variance is the same on every rank, so averaging ``u``
is averaging ``m``; but ``u`` has Adam's per-element scale (order one everywhere), while
``m`` spans orders of magnitude inside one compression chunk (a bias before batch norm has
gradients of 1e-10 next to weights of 1e-2). Compressing ``m`` would give such elements
the chunk's error, which division by their tiny ``sqrt(v)`` turns into huge steps. Use it with :class:`QAdamOptimizer`::

    ddp = commlib.DistributedDataParallel(model, algorithm="qadam", warmup_steps=100)
    opt = commlib.algorithms.qadam.QAdamOptimizer(ddp.parameters(), lr=1e-3)
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from ..primitives import CompressionState, allreduce, compressed_allreduce
from ..reduce_ops import ReduceOp
from .base import Algorithm, Context
from .buckets import Bucket
from .registry import register


class QAdamOptimizer(torch.optim.Optimizer):
    """Adam that freezes its variance when ``qadam`` ends the warm-up; afterwards the
    momentum is maintained (and averaged) by the algorithm, not by the optimizer.

    ``variance_floor``: when the variance is frozen, each element's bias-corrected variance
    is raised to at least ``variance_floor`` times the mean of its tensor. An element that
    saw no gradient during the warm-up (a pixel that is always zero in those batches) would
    otherwise be divided by ``eps`` alone the first time it gets one.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, variance_floor: float = 1e-4) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      variance_floor=variance_floor))
        self.compressing = False

    @torch.no_grad()
    def freeze(self) -> None:
        """End of warm-up: fix ``state["denom"] = sqrt(max(v_hat, floor)) + eps`` per
        parameter; steps from now on use the momentum the algorithm maintains."""
        self.compressing = True
        for group in self.param_groups:
            beta2 = group["betas"][1]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(step=0, frozen_step=0, exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p))
                v_hat = state["exp_avg_sq"] / (1 - beta2 ** max(state["frozen_step"], 1))
                floor = group["variance_floor"] * v_hat.mean()
                state["denom"] = v_hat.clamp_(min=float(floor)).sqrt_().add_(group["eps"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    state["frozen_step"] = 0
                state["step"] += 1
                if not self.compressing:
                    g = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] \
                        else p.grad
                    state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
                    state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    state["frozen_step"] = state["step"]
                m_hat = 1 - beta1 ** state["step"]
                if self.compressing:
                    denom = state["denom"]
                else:
                    v_hat = 1 - beta2 ** state["frozen_step"]
                    denom = (state["exp_avg_sq"] / v_hat).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / m_hat)
        return loss


@register("qadam")
class QAdam(Algorithm):
    """``warmup_steps``: full-precision steps before compression starts.
    ``compression``: ``"sign1"`` (error feedback) or ``"minmax_uint8"``.
    ``hierarchical``: node-local full-precision reduce first. ``chunk_size``: elements per
    compression chunk. ``max_update``: bound on ``|u|`` (Adam's normalized step) before
    compression."""

    def __init__(self, warmup_steps: int = 100, compression: str = "sign1",
                 hierarchical: bool = False, chunk_size: int = 2048,
                 max_update: float = 10.0) -> None:
        if compression not in ("sign1", "minmax_uint8"):
            raise ValueError(f"qadam: compression must be 'sign1' or 'minmax_uint8', "
                             f"got {compression!r}")
        self.warmup_steps = int(warmup_steps)
        self.compression = compression
        self.hierarchical = bool(hierarchical)
        self.chunk_size = int(chunk_size)
        self.max_update = float(max_update)
        self.compressing = False
        self._optimizer: QAdamOptimizer | None = None
        self._momentum: list[torch.Tensor] = []
        self._next: list[torch.Tensor] = []  # this step's momentum, kept if finite
        self._denom: list[torch.Tensor] = []
        self._states: list[CompressionState] = []

    def before_optimizer_step(self, ctx: Context, optimizer: Any) -> None:
        if not isinstance(optimizer, QAdamOptimizer):
            raise TypeError(f"qadam: the optimizer must be commlib.algorithms.qadam."
                            f"QAdamOptimizer, got {type(optimizer).__name__}")
        self._optimizer = optimizer
        if self.compressing and not optimizer.compressing:
            self._bind(ctx, optimizer)

    def need_reset(self, ctx: Context) -> bool:
        return not self.compressing and ctx.step >= self.warmup_steps

    def reset(self, ctx: Context) -> None:
        self.compressing = True

    def make_buckets(self, ctx: Context) -> list[Bucket]:
        buckets = super().make_buckets(ctx)
        self._momentum = [torch.zeros_like(b.flat) for b in buckets]
        self._next = [torch.empty_like(b.flat) for b in buckets]
        self._states = [CompressionState() for _ in buckets]
        if self.compressing and self._optimizer is not None:
            self._bind(ctx, self._optimizer, buckets)
        return buckets

    def _bind(self, ctx: Context, optimizer: QAdamOptimizer,
              buckets: list[Bucket] | None = None) -> None:
        """Freeze the optimizer and move its momentum and frozen denominators into the
        bucket-shaped buffers the exchange works on (the optimizer keeps views of them)."""
        if not optimizer.compressing:
            optimizer.freeze()
        self._denom = []
        for bucket, flat in zip(buckets or ctx.buckets, self._momentum):
            denom = torch.empty_like(flat)
            for p, offset, numel in zip(bucket.tensors, bucket.offsets, bucket.numels):
                state = optimizer.state[p]
                for buffer, key in ((flat, "exp_avg"), (denom, "denom")):
                    view = buffer[offset:offset + numel].view_as(p)
                    view.copy_(state[key])
                    state[key] = view
            self._denom.append(denom)

    def on_bucket_ready(self, ctx: Context, bucket: Bucket) -> Any:
        if not self.compressing:
            return allreduce(bucket.flat, op=ReduceOp.AVG, group=ctx.group, async_op=True)
        group = self._optimizer.param_groups[0] if self._optimizer else {"betas": (0.9, 0.999),
                                                                          "weight_decay": 0.0}
        beta1, wd = group["betas"][0], group["weight_decay"]
        m, u = self._momentum[bucket.index], self._next[bucket.index]
        with torch.no_grad():
            g = bucket.flat
            if wd:
                g = g + wd * torch.cat([p.detach().reshape(-1) for p in bucket.tensors])
            torch.mul(m, beta1, out=u).add_(g, alpha=1 - beta1)
            # Bounded like Adam's own steps, so one outlier cannot stretch the range of a
            # compression chunk and drown its neighbours in quantization error.
            u.div_(self._denom[bucket.index]).clamp_(-self.max_update, self.max_update)
        compressed_allreduce(u, op=ReduceOp.AVG, group=ctx.group, method=self.compression,
                             chunk_size=self.chunk_size, state=self._states[bucket.index],
                             hierarchical=self.hierarchical, commit=False)
        with torch.no_grad():
            u.mul_(self._denom[bucket.index])
        return None

    def after_backward(self, ctx: Context) -> None:
        """Keep the step's momentum and residuals if every bucket's result is finite (the
        same on every rank); otherwise keep nothing and make every gradient NaN."""
        if not self.compressing:
            return
        finite = all(state.finite for state in self._states)
        with torch.no_grad():
            for bucket, m, u, state in zip(ctx.buckets, self._momentum, self._next,
                                           self._states):
                if finite:
                    state.commit()
                    m.copy_(u)
                else:
                    state.discard()
                    bucket.flat.fill_(float("nan"))
