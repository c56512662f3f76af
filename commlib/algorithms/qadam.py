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

    # run: mpiexec -n 2
    import torch
    import commlib
    from commlib.algorithms.qadam import QAdamOptimizer

    model = torch.nn.Linear(8, 2)
    ddp = commlib.DistributedDataParallel(model, algorithm="qadam", warmup_steps=2)
    opt = QAdamOptimizer(ddp.parameters(), lr=1e-3)
    for step in range(4):                    # 2 warm-up steps, then compressed momentum
        opt.zero_grad()
        ddp(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from ..base.reduce_ops import ReduceOp
from ..primitives import CompressionState, allreduce, compressed_allreduce
from ..primitives.compressed import release_workspaces
from . import precision, state
from .base import Algorithm, Context
from .buckets import Bucket
from .qadam_optimizer import QAdamOptimizer
from .registry import register

__all__ = ["QAdam", "QAdamOptimizer"]


class _Run:
    """Consecutive tensors of a bucket in one param group: the elements ``start:end`` of
    its flat buffer are updated with that group's ``beta1`` and ``weight_decay``."""

    __slots__ = ("start", "end", "beta1", "weight_decay", "params")

    def __init__(self, start: int, end: int, beta1: float, weight_decay: float,
                 params: list[torch.Tensor]) -> None:
        self.start, self.end = start, end
        self.beta1, self.weight_decay, self.params = beta1, weight_decay, params


def _runs(ctx: Context, bucket: Bucket, optimizer: QAdamOptimizer) -> list[_Run]:
    """The :class:`_Run` s of ``bucket`` under ``optimizer``'s param groups."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    names = dict((id(p), n) for n, p in ctx.named_parameters)
    runs: list[_Run] = []
    for p, offset, numel in zip(bucket.tensors, bucket.offsets, bucket.numels):
        group = group_of.get(id(p))
        if group is None:
            raise ValueError(f"qadam (rank {ctx.rank}): parameter {names.get(id(p), '?')!r} "
                             f"is in no param group of the QAdamOptimizer; give it every "
                             f"parameter of the wrapped module that requires grad")
        beta1, wd = float(group["betas"][0]), float(group["weight_decay"])
        last = runs[-1] if runs else None
        if last is not None and last.end == offset and (last.beta1, last.weight_decay) == \
                (beta1, wd):
            last.end += numel
            last.params.append(p)
        else:
            runs.append(_Run(offset, offset + numel, beta1, wd, [p]))
    return runs


@register("qadam")
class QAdam(Algorithm):
    """``warmup_steps``: full-precision iterations before compression starts (0: from the
    first one; the optimizer then has no variance to freeze, see :class:`QAdamOptimizer`).
    ``compression``: ``"sign1"`` (error feedback) or ``"minmax_uint8"``.
    ``hierarchical``: node-local full-precision reduce first. ``chunk_size``: elements per
    compression chunk. ``max_update``: bound on ``|u|`` (Adam's normalized step) before
    compression. ``comm_dtype``/``predivide_factor``: the warm-up's gradient exchange, as
    in ``gradient_allreduce`` (:mod:`commlib.algorithms.precision`). Each parameter's momentum uses the ``betas[0]`` and ``weight_decay`` of
    its own param group. State (:meth:`state_dict`): the phase, the momentum, the frozen
    denominators and this rank's error-feedback residuals, per bucket."""

    per_rank_state = True

    def __init__(self, warmup_steps: int = 100, compression: str = "sign1",
                 hierarchical: bool = False, chunk_size: int = 2048,
                 max_update: float = 10.0, comm_dtype: torch.dtype | str | None = None,
                 predivide_factor: float = 1.0) -> None:
        self.comm_dtype, self.predivide_factor = precision.check(
            "qadam", comm_dtype, predivide_factor)
        if compression not in ("sign1", "minmax_uint8"):
            raise ValueError(f"qadam: compression must be 'sign1' or 'minmax_uint8', "
                             f"got {compression!r}")
        self.warmup_steps = int(warmup_steps)
        self.compression = compression
        self.hierarchical = bool(hierarchical)
        self.chunk_size = int(chunk_size)
        self.max_update = float(max_update)
        self.compressing = False
        self._seen: QAdamOptimizer | None = None   # the optimizer seen stepping
        self._bound: QAdamOptimizer | None = None  # the one whose state views our buffers
        self._loaded = False  # buffers hold a loaded state not yet bound to the optimizer
        self._momentum: list[torch.Tensor] = []
        self._next: list[torch.Tensor] = []  # this step's momentum, kept if finite
        self._denom: list[torch.Tensor] = []
        self._states: list[CompressionState] = []
        self._runs: list[list[_Run]] = []

    def before_forward(self, ctx: Context) -> None:
        if self.compressing and self._bound is None:
            optimizer = self._seen or QAdamOptimizer.holding(p for _, p in ctx.named_parameters)
            if optimizer is None:
                raise TypeError(f"qadam (rank {ctx.rank}): compression starts at iteration "
                                f"{ctx.step} and needs the commlib.algorithms.qadam."
                                f"QAdamOptimizer of the wrapped module's parameters; create it "
                                f"before the first forward")
            self._bind(ctx, optimizer)

    def before_optimizer_step(self, ctx: Context, optimizer: Any) -> None:
        if not isinstance(optimizer, QAdamOptimizer):
            raise TypeError(f"qadam: the optimizer must be commlib.algorithms.qadam."
                            f"QAdamOptimizer, got {type(optimizer).__name__}")
        self._seen = optimizer
        if self.compressing:
            if optimizer is not self._bound:
                self._bind(ctx, optimizer)
            else:  # hyperparameters may have changed (a scheduler): next backward's
                self._runs = [_runs(ctx, b, optimizer) for b in ctx.buckets]

    def need_reset(self, ctx: Context) -> bool:
        return not self.compressing and ctx.step >= self.warmup_steps

    def reset(self, ctx: Context) -> None:
        self.compressing = True

    def make_buckets(self, ctx: Context) -> list[Bucket]:
        buckets = super().make_buckets(ctx)
        self._momentum = [torch.zeros_like(b.flat) for b in buckets]
        self._next = [torch.empty_like(b.flat) for b in buckets]
        self._states = [CompressionState() for _ in buckets]
        self._bound = None  # new buffers: bound before the next backward (before_forward)
        return buckets

    def _bind(self, ctx: Context, optimizer: QAdamOptimizer) -> None:
        """Move the optimizer's momentum and frozen denominators into the bucket-shaped
        buffers the exchange works on; the optimizer keeps views of them. At the end of
        the warm-up the optimizer is frozen and its values are copied in; after
        :meth:`load_state_dict` the loaded buffers are kept and the (loaded) optimizer
        adopts them."""
        adopt = self._loaded and optimizer.compressing
        if self._loaded and not optimizer.compressing:
            raise ValueError(f"qadam (rank {ctx.rank}): the loaded algorithm state is past "
                             f"the warm-up but the QAdamOptimizer's is not; load the "
                             f"optimizer's state_dict saved with it too")
        if not optimizer.compressing:
            optimizer.freeze()
        if not adopt:
            self._denom = [torch.empty_like(flat) for flat in self._momentum]
        names = dict((id(p), n) for n, p in ctx.named_parameters)
        for bucket, flat, denom in zip(ctx.buckets, self._momentum, self._denom):
            for p, offset, numel in zip(bucket.tensors, bucket.offsets, bucket.numels):
                opt_state = optimizer.state[p]
                if "denom" not in opt_state:
                    raise ValueError(f"qadam (rank {ctx.rank}): parameter "
                                     f"{names.get(id(p), '?')!r} is not in the QAdamOptimizer")
                for buffer, key in ((flat, "exp_avg"), (denom, "denom")):
                    view = buffer[offset:offset + numel].view_as(p)
                    if not adopt:
                        view.copy_(opt_state[key])
                    opt_state[key] = view
        self._runs = [_runs(ctx, b, optimizer) for b in ctx.buckets]
        self._bound, self._seen, self._loaded = optimizer, optimizer, False
        optimizer._binder = weakref.ref(self)

    def optimizer_loaded(self, optimizer: QAdamOptimizer) -> None:
        """Called by :meth:`QAdamOptimizer.load_state_dict` of the bound optimizer: its
        loaded values go into the buffers, which it views again."""
        if optimizer is not self._bound:
            return
        self._bound, self._loaded = None, False
        if self.compressing and optimizer.compressing and self._ctx is not None:
            self._bind(self._ctx, optimizer)

    def on_bucket_ready(self, ctx: Context, bucket: Bucket) -> Any:
        if not self.compressing:
            if precision.is_plain(bucket.flat, self.comm_dtype, self.predivide_factor):
                return allreduce(bucket.flat, op=ReduceOp.AVG, group=ctx.group, async_op=True)
            precision.average(bucket.flat, ctx.world_size, self.comm_dtype,
                              self.predivide_factor,
                              lambda t: allreduce(t, ReduceOp.SUM, ctx.group))
            return None
        m, u = self._momentum[bucket.index], self._next[bucket.index]
        with torch.no_grad():
            self._update_momentum(bucket, m, u)
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
        finite = all(cs.finite for cs in self._states)
        with torch.no_grad():
            for bucket, m, u, cs in zip(ctx.buckets, self._momentum, self._next,
                                        self._states):
                if finite:
                    cs.commit()
                    m.copy_(u)
                else:
                    cs.discard()
                    bucket.flat.fill_(float("nan"))

    def regroup(self, saved_rank: int, saved_world_size: int) -> None:
        """In another group (a shrink): the server-side error-feedback residuals are of
        this rank's share of each bucket in the old group (``1/n`` of it, at the rank's
        position), which the new group cuts otherwise: they are dropped (the server's
        error feedback starts again from zero, as at the start of compression). The
        worker residuals are of this rank's whole contribution and stay (zeroed on first
        use if the padding for the new size differs). Rank-local."""
        ctx = self._context("regroup")
        if (saved_rank, saved_world_size) != (ctx.rank, ctx.world_size):
            for cs in self._states:
                cs.server = None

    def teardown(self, ctx: Context) -> None:
        ctx.run(release_workspaces)  # cached on the thread that ran the exchanges

    def _update_momentum(self, bucket: Bucket, m: torch.Tensor, out: torch.Tensor) -> None:
        """``out = beta1 m + (1 - beta1) (g + weight_decay p)`` over the bucket's flat
        buffers, each element with the ``beta1`` and ``weight_decay`` of its parameter's
        param group (``out`` may be ``m``)."""
        g = bucket.flat
        for run in self._runs[bucket.index]:
            a, b = run.start, run.end
            grad = g[a:b]
            if run.weight_decay:
                grad = grad + run.weight_decay * torch.cat([p.detach().reshape(-1)
                                                            for p in run.params])
            torch.mul(m[a:b], run.beta1, out=out[a:b]).add_(grad, alpha=1 - run.beta1)

    # -- saving and resuming -------------------------------------------------------------
    def save_state(self, ctx: Context) -> dict[str, Any]:
        """The phase, and per bucket the momentum, the frozen denominators (once
        compressing) and the error-feedback residuals (``None`` until first used)."""
        return {"compressing": self.compressing, "buckets": state.bucket_layout(ctx.buckets),
                "momentum": list(self._momentum),
                "denom": list(self._denom) if self.compressing else [],
                "residuals": [{"worker": s.worker, "server": s.server} for s in self._states]}

    def load_state(self, ctx: Context, saved: Mapping[str, Any], where: str) -> None:
        state.check_keys(where, saved, ("compressing", "buckets", "momentum", "denom",
                                        "residuals"))
        state.check_layout(where, saved["buckets"], ctx.buckets)
        compressing = bool(saved["compressing"])
        for k, flat in enumerate(self._momentum):
            state.check_tensor(where, f"momentum of bucket {k}", saved["momentum"][k], flat)
            if compressing:
                state.check_tensor(where, f"denominators of bucket {k}", saved["denom"][k], flat)
            for key, value in saved["residuals"][k].items():
                if value is not None:
                    state.check_tensor(where, f"{key} residual of bucket {k}", value,
                                       (value.numel(),), torch.float32)
        self.compressing = compressing
        for flat, m in zip(self._momentum, saved["momentum"]):
            state.copy_into(flat, m)
        self._denom = [state.restore(d, flat.device)
                       for d, flat in zip(saved["denom"], self._momentum)]
        # Compressing: the optimizer adopts these buffers before the next backward.
        self._bound, self._loaded = None, compressing
        for s, flat, res in zip(self._states, self._momentum, saved["residuals"]):
            s.reset()
            s.worker = None if res["worker"] is None else state.restore(res["worker"],
                                                                         flat.device)
            s.server = None if res["server"] is None else state.restore(res["server"],
                                                                         flat.device)
