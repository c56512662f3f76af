"""``local_sgd``: the communication-delay relaxation. Every rank takes ``sync_every``
optimizer steps on its own data, then the models are averaged (an allreduce of the weights);
weight bytes equal gradient bytes, so communication is about ``1/sync_every`` of
``gradient_allreduce``'s.

Non-finite weights are never averaged into the replicas: an average holding NaN or Inf
(the same on every rank) is not applied, and every rank raises
:class:`~commlib.errors.NonFiniteError` naming the ranks whose weights are not finite."""
from __future__ import annotations

from typing import Any

from ..errors import NonFiniteError
from ..primitives import allreduce
from ..primitives.finite import all_finite, nonfinite_ranks
from ..reduce_ops import ReduceOp
from .base import WEIGHTS, Algorithm, Context
from .buckets import pack, unpack
from .registry import register


@register("local_sgd")
class LocalSGD(Algorithm):
    """Average the models after every ``sync_every``-th optimizer step (on every rank, after
    the step, before the next forward). Between averages the replicas differ."""

    exchanges = WEIGHTS

    def __init__(self, sync_every: int = 4) -> None:
        if int(sync_every) < 1:
            raise ValueError(f"local_sgd: sync_every must be >= 1, got {sync_every}")
        self.sync_every = int(sync_every)

    def after_optimizer_step(self, ctx: Context, optimizer: Any) -> None:
        if ctx.step % self.sync_every == 0:
            ctx.run(self._average, ctx)

    def _average(self, ctx: Context) -> None:
        works = [allreduce(pack(b), op=ReduceOp.AVG, group=ctx.group, async_op=True)
                 for b in ctx.buckets]
        bad = []
        for work, bucket in zip(works, ctx.buckets):
            work.wait()
            if all_finite(bucket.flat):
                unpack(bucket)
            else:  # the same average on every rank: all take this path
                bad.append(bucket.index)
        if bad:
            own = all(all_finite(t) for b in ctx.buckets for t in b.tensors)
            raise NonFiniteError(
                f"local_sgd (rank {ctx.rank}): the weights of rank(s) "
                f"{nonfinite_ranks(own, ctx.group)} are not finite at optimizer step "
                f"{ctx.step} (a step taken on non-finite gradients?); the average of "
                f"bucket(s) {bad} was not applied")
