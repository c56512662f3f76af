"""``gradient_allreduce``: synchronous data parallelism, gradients averaged with allreduce."""
from __future__ import annotations

from typing import Any

from ..primitives import allreduce
from ..reduce_ops import ReduceOp
from .base import Algorithm, Context
from .buckets import Bucket
from .registry import register


@register("gradient_allreduce")
class GradientAllReduce(Algorithm):
    """Average (or sum) each bucket of gradients over the group, overlapped with backward.

    ``hierarchical``: reduce inside each node, allreduce among node leaders, broadcast
    inside the node. ``average``: divide by the group size (``False`` sums). After backward
    every rank holds the same gradients.
    """

    def __init__(self, hierarchical: bool = False, average: bool = True) -> None:
        self.hierarchical = bool(hierarchical)
        self.average = bool(average)

    def on_bucket_ready(self, ctx: Context, bucket: Bucket) -> Any:
        op = ReduceOp.AVG if self.average else ReduceOp.SUM
        return allreduce(bucket.flat, op=op, group=ctx.group, async_op=True,
                         hierarchical=self.hierarchical)
