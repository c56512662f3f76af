"""``gradient_allreduce``: synchronous data parallelism, gradients averaged with allreduce."""
from __future__ import annotations

from typing import Any

import torch

from ..base.reduce_ops import ReduceOp
from ..primitives import allreduce, allreduce_from
from . import precision
from .base import Algorithm, Context
from .buckets import Bucket
from .registry import register


@register("gradient_allreduce")
class GradientAllReduce(Algorithm):
    """Average (or sum) each bucket of gradients over the group, overlapped with backward.

    ``hierarchical``: reduce inside each node, allreduce among node leaders, broadcast
    inside the node. ``average``: divide by the group size (``False`` sums).
    ``comm_dtype``: exchange each bucket in this floating dtype (``torch.bfloat16`` or
    ``torch.float16`` halve the bytes of float32 gradients; cast back after the sum);
    ``None`` keeps the gradients' dtype. ``predivide_factor`` ``f``: divide by ``f``
    before the sum and by ``n / f`` after it (Horovod's ``gradient_predivide_factor``; see
    :mod:`commlib.algorithms.precision`). After backward every rank holds the same
    gradients.
    """

    def __init__(self, hierarchical: bool = False, average: bool = True,
                 comm_dtype: torch.dtype | str | None = None,
                 predivide_factor: float = 1.0) -> None:
        self.hierarchical = bool(hierarchical)
        self.average = bool(average)
        self.comm_dtype, self.predivide_factor = precision.check(
            "gradient_allreduce", comm_dtype, predivide_factor, self.average)

    @property  # type: ignore[override]
    def fuses_bucket_copy(self) -> bool:  # noqa: D401
        """The gradients' copy into the bucket goes into the exchange itself (flat, and
        unless a subclass replaces :meth:`on_bucket_ready`)."""
        return not self.hierarchical and \
            type(self).on_bucket_ready is GradientAllReduce.on_bucket_ready

    def on_bucket_ready(self, ctx: Context, bucket: Bucket) -> Any:
        if precision.is_plain(bucket.flat, self.comm_dtype, self.predivide_factor):
            op = ReduceOp.AVG if self.average else ReduceOp.SUM
            if not self.hierarchical:  # the same call on every rank, deferred or not
                return allreduce_from(bucket.pieces(), bucket.flat, op=op, group=ctx.group,
                                      async_op=True, hierarchical=False)
            return allreduce(bucket.flat, op=op, group=ctx.group, async_op=True,
                             hierarchical=self.hierarchical)
        bucket.fill()
        precision.average(bucket.flat, ctx.world_size, self.comm_dtype, self.predivide_factor,
                          lambda t: allreduce(t, ReduceOp.SUM, ctx.group,
                                              hierarchical=self.hierarchical),
                          divide=self.average)
        return None
