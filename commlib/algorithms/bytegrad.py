"""``bytegrad``: gradients averaged through the compressed (min-max uint8) allreduce.

Each bucket of gradients is exchanged as one byte per element plus 8 bytes per chunk of
``chunk_size`` elements: about a quarter of ``gradient_allreduce``'s bytes on the wire, at
the price of a quantization error of at most ``(max - min) / 510`` per chunk per
compression (two compressions per exchange). Every rank ends with identical gradients.
"""
from __future__ import annotations

from ..base.reduce_ops import ReduceOp
from ..primitives import compressed_allreduce
from ..primitives.compressed import release_workspaces
from .base import Algorithm, Context
from .buckets import Bucket
from .registry import register


@register("bytegrad")
class ByteGrad(Algorithm):
    """``hierarchical``: full-precision reduce inside each node, compressed allreduce
    among node leaders. ``average``: divide by the group size (else sum).
    ``chunk_size``: elements per quantization chunk (its own min and max)."""

    def __init__(self, hierarchical: bool = False, average: bool = True,
                 chunk_size: int = 2048) -> None:
        self.hierarchical = bool(hierarchical)
        self.average = bool(average)
        self.chunk_size = int(chunk_size)

    def on_bucket_ready(self, ctx: Context, bucket: Bucket) -> None:
        op = ReduceOp.AVG if self.average else ReduceOp.SUM
        compressed_allreduce(bucket.flat, op=op, group=ctx.group, method="minmax_uint8",
                             chunk_size=self.chunk_size, hierarchical=self.hierarchical)

    def teardown(self, ctx: Context) -> None:
        ctx.run(release_workspaces)  # cached on the thread that ran the exchanges
