"""``diloco``: DiLoCo (Douillard et al., 2023, arXiv 2311.08105): inner steps with the user's
optimizer, then an outer Nesterov-SGD step on the averaged pseudo-gradient.

.. not run: pseudocode of the algorithm's step

Every rank keeps the *global* weights ``g`` (the same on every rank) and trains its own
replica ``x`` with the user's (inner) optimizer for ``sync_every`` (H) iterations. Then,
once every optimizer of the H-th iteration stepped (before the next forward, or in
``average_parameters()``), the outer step::

    delta = avg over the group of (g - x)          # the pseudo-gradient: one allreduce
    g     = OuterSGD(g, grad=delta)                # lr outer_lr, Nesterov momentum
    x     = g                                      # every replica restarts from g

``OuterSGD`` is ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum,
nesterov=outer_nesterov)`` over flat copies of the global weights (a plain averaging step
when ``outer_lr=1, outer_momentum=0``: DiLoCo is then ``local_sgd``). The inner optimizer's
state (Adam moments, ...) is the user's and carries over outer steps, as in the paper. One
allreduce of the weights' size every H iterations: ``1/H`` of ``gradient_allreduce``'s
bytes. Global weights of float16/bfloat16 parameters are kept, averaged and stepped in
float32.

State (:meth:`state_dict`): the global weights and the outer momentum, the same on every
rank; resumed exactly. Non-finite weights are never stepped into the global ones: when the
averaged pseudo-gradient holds NaN or Inf (the same on every rank), nothing is applied and
every rank raises :class:`~commlib.base.errors.NonFiniteError` naming the ranks whose weights
are not finite. A step that ``torch.amp.GradScaler`` skipped on one rank leaves that rank's
weights finite and needs nothing from the others (gradients never travel).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..base.errors import NonFiniteError
from ..base.reduce_ops import ReduceOp
from ..primitives import allreduce
from ..primitives.finite import all_finite, nonfinite_ranks
from . import state
from .base import WEIGHTS, Algorithm, Context
from .buckets import Bucket, pack, unpack
from .registry import register


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype global weights, pseudo-gradients and the outer state are kept in."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@register("diloco")
class DiLoCo(Algorithm):
    """``sync_every`` (H): inner iterations between outer steps. ``outer_lr``,
    ``outer_momentum``, ``outer_nesterov``: the outer SGD (the paper's 0.7, 0.9, Nesterov).
    The inner optimizer is whatever optimizer the user steps."""

    exchanges = WEIGHTS

    def __init__(self, sync_every: int = 16, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, outer_nesterov: bool = True) -> None:
        name = type(self).name
        if isinstance(sync_every, bool) or int(sync_every) != sync_every or sync_every < 1:
            raise ValueError(f"{name}: sync_every must be an integer >= 1, got {sync_every!r}")
        if not outer_lr > 0:
            raise ValueError(f"{name}: outer_lr must be > 0, got {outer_lr!r}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"{name}: outer_momentum must be in [0, 1), got "
                             f"{outer_momentum!r}")
        self.sync_every = int(sync_every)
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.outer_nesterov = bool(outer_nesterov) and self.outer_momentum > 0
        self._global: list[torch.Tensor] = []
        self._outer: torch.optim.SGD | None = None

    # -- buckets and the global weights ---------------------------------------------------
    def plan_buckets(self, ctx: Context) -> list[Bucket]:
        """The weight buckets (subclasses group them differently)."""
        return super().make_buckets(ctx)

    def make_buckets(self, ctx: Context) -> list[Bucket]:
        """Buckets of weights and the global copies: made at construction, right after the
        parameters were broadcast from rank 0, so the global weights start equal to every
        replica on every rank."""
        buckets = self.plan_buckets(ctx)
        if len(self._global) != len(buckets):
            with torch.no_grad():
                self._global = [pack(b).to(master_dtype(b.dtype), copy=True).requires_grad_()
                                for b in buckets]
            self._outer = torch.optim.SGD(self._global, lr=self.outer_lr,
                                          momentum=self.outer_momentum,
                                          nesterov=self.outer_nesterov)
        return buckets

    # -- the outer step -------------------------------------------------------------------
    def synced_at(self, step: int) -> bool:
        """Right after each outer step: every replica is the global weights, and the global
        weights and outer momentum are the same on every rank (the inner optimizer's state
        is the user's, each rank's own)."""
        return step % self.sync_every == 0

    def after_iteration(self, ctx: Context) -> None:
        if ctx.step % self.sync_every == 0:
            ctx.run(self._sync, ctx)

    def _sync(self, ctx: Context) -> None:
        buckets = ctx.buckets
        deltas = self.pseudo_gradients(buckets)
        works = [allreduce(d, op=ReduceOp.AVG, group=ctx.group, async_op=True) for d in deltas]
        for work in works:
            work.wait()
        self.check_finite(ctx, buckets, deltas)
        self.outer_step(buckets, deltas)
        for bucket in buckets:
            self.write_weights(bucket, self._global[bucket.index])

    def pseudo_gradients(self, buckets: Sequence[Bucket]) -> list[torch.Tensor]:
        """``g - x`` of each bucket: new tensors in the global weights' dtype."""
        with torch.no_grad():
            return [self._global[b.index].detach() - pack(b).to(self._global[b.index].dtype)
                    for b in buckets]

    def check_finite(self, ctx: Context, buckets: Sequence[Bucket],
                     averaged: Sequence[torch.Tensor], group: Any = None) -> None:
        """Raise on every rank (the averages are the same everywhere) when an averaged
        pseudo-gradient is not finite, naming the ranks whose weights are not; collective
        over ``group`` (default the wrapper's) only on that path."""
        bad = [b.index for b, d in zip(buckets, averaged) if not all_finite(d)]
        if not bad:
            return
        own = all(all_finite(t) for b in buckets for t in b.tensors)
        raise NonFiniteError(
            f"{self.name} (rank {ctx.rank}): the weights of rank(s) "
            f"{nonfinite_ranks(own, group or ctx.group)} are not finite at iteration "
            f"{ctx.step} (a step taken on non-finite gradients?); the outer step was not "
            f"applied (non-finite pseudo-gradient in bucket(s) {bad})")

    def outer_step(self, buckets: Sequence[Bucket], averaged: Sequence[torch.Tensor]) -> None:
        """Step the global weights of ``buckets`` (only theirs: the others get no gradient,
        so torch's SGD leaves them and their momentum alone)."""
        for b, d in zip(buckets, averaged):
            self._global[b.index].grad = d
        self._outer.step()
        for b in buckets:
            self._global[b.index].grad = None

    @staticmethod
    def write_weights(bucket: Bucket, values: torch.Tensor) -> None:
        """The bucket's parameters become ``values`` (flat, any dtype), in place."""
        with torch.no_grad():
            bucket.flat.copy_(values)
        unpack(bucket)

    # -- saving and resuming --------------------------------------------------------------
    def save_state(self, ctx: Context) -> dict[str, Any]:
        """The global weights and the outer momentum of each bucket (``None`` before the
        first outer step), the same on every rank."""
        momentum = [self._outer.state.get(g, {}).get("momentum_buffer") for g in self._global]
        return {"buckets": state.bucket_layout(ctx.buckets),
                "global": [g.detach() for g in self._global], "momentum": momentum}

    def check_state(self, ctx: Context, saved: Mapping[str, Any], where: str,
                    keys: Sequence[str] = ()) -> None:
        state.check_keys(where, saved, ("buckets", "global", "momentum", *keys))
        state.check_layout(where, saved["buckets"], ctx.buckets)
        for k, g in enumerate(self._global):
            state.check_tensor(where, f"the global weights of bucket {k}", saved["global"][k], g)
            m = saved["momentum"][k]
            if m is not None:
                state.check_tensor(where, f"the outer momentum of bucket {k}", m, g)

    def load_state(self, ctx: Context, saved: Mapping[str, Any], where: str) -> None:
        self.check_state(ctx, saved, where)
        self.restore(saved)

    def restore(self, saved: Mapping[str, Any]) -> None:
        for g, value, m in zip(self._global, saved["global"], saved["momentum"]):
            state.copy_into(g, value)
            if m is None:
                self._outer.state.pop(g, None)
            else:
                self._outer.state[g] = {"momentum_buffer": state.restore(m, g.device)}
