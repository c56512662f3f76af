"""``local_sgd``: the communication-delay relaxation. Every rank takes ``sync_every``
iterations on its own data, then the models are averaged (an allreduce of the weights);
weight bytes equal gradient bytes, so communication is about ``1/sync_every`` of
``gradient_allreduce``'s."""
from __future__ import annotations

from ..primitives import allreduce
from ..reduce_ops import ReduceOp
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

    def after_iteration(self, ctx: Context) -> None:
        if ctx.step % self.sync_every == 0:
            ctx.run(self._average, ctx)

    def _average(self, ctx: Context) -> None:
        works = [allreduce(pack(b), op=ReduceOp.AVG, group=ctx.group, async_op=True)
                 for b in ctx.buckets]
        for work, bucket in zip(works, ctx.buckets):
            work.wait()
            unpack(bucket)
