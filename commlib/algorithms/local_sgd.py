"""``local_sgd``: the communication-delay relaxation. Every rank takes ``sync_every``
iterations on its own data, then the models are averaged (an allreduce of the weights);
weight bytes equal gradient bytes, so communication is about ``1/sync_every`` of
``gradient_allreduce``'s.

Non-finite weights are never averaged into the replicas: when an average holds NaN or
Inf (the same on every rank), no bucket's average is applied, and every rank raises
:class:`~commlib.base.errors.NonFiniteError` naming the ranks whose weights are not finite."""
from __future__ import annotations

from ..base.errors import NonFiniteError
from ..base.reduce_ops import ReduceOp
from ..primitives import allreduce
from ..primitives.finite import all_finite, nonfinite_ranks
from .base import WEIGHTS, Algorithm, Context
from .buckets import pack, unpack
from .registry import register


@register("local_sgd")
class LocalSGD(Algorithm):
    """Average the models after every ``sync_every``-th iteration (on every rank, once all
    optimizers of the iteration stepped, before the next forward, or in
    ``average_parameters()``). Between averages the replicas differ."""

    exchanges = WEIGHTS

    def __init__(self, sync_every: int = 4) -> None:
        if int(sync_every) < 1:
            raise ValueError(f"local_sgd: sync_every must be >= 1, got {sync_every}")
        self.sync_every = int(sync_every)

    def synced_at(self, step: int) -> bool:
        """Right after each average (every ``sync_every``-th iteration)."""
        return step % self.sync_every == 0

    def after_iteration(self, ctx: Context) -> None:
        if ctx.step % self.sync_every == 0:
            ctx.run(self._average, ctx)

    def _average(self, ctx: Context) -> None:
        works = [allreduce(pack(b), op=ReduceOp.AVG, group=ctx.group, async_op=True)
                 for b in ctx.buckets]
        for work in works:
            work.wait()
        # The same averages on every rank: all apply them, or all raise.
        bad = [b.index for b in ctx.buckets if not all_finite(b.flat)]
        if bad:
            own = all(all_finite(t) for b in ctx.buckets for t in b.tensors)
            raise NonFiniteError(
                f"local_sgd (rank {ctx.rank}): the weights of rank(s) "
                f"{nonfinite_ranks(own, ctx.group)} are not finite at iteration "
                f"{ctx.step} (a step taken on non-finite gradients?); the average was not "
                f"applied (non-finite in bucket(s) {bad})")
        for bucket in ctx.buckets:
            unpack(bucket)
