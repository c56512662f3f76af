"""``low_precision_decentralized``: decentralized SGD over a ring whose links carry
min-max uint8-compressed weight differences.

.. not run: pseudocode of the algorithm's step

This is DCD-PSGD (Tang et al., 2018, "Communication Compression for Decentralized
Training"). Every rank keeps replicas that both ends of a link update identically: its
copies of the left and right neighbours' weights (``x_left``, ``x_right``) and the public
version of its own weights that the neighbours hold (``x_pub``, which is also where its
own weights start every step). The optimizer step takes the local weights from ``x_pub``
to ``x = x_pub - lr * update``. After every ``communication_interval``-th step::

    target = mean(x_pub, x_left, x_right) + (x - x_pub)   # gossip average + local step
    q      = compress(target - x_pub)                     # sent to both neighbours
    x_pub += decompress(q); x_left += decompress(q_left); x_right += decompress(q_right)
    x      = x_pub

The mean runs over the distinct ring members (two with two ranks). Each link carries one
byte per weight per direction (plus 8 bytes per chunk), and replicas never drift: both
ends add the same decompressed bytes.

Non-finite weights are never sent into the replicas: a rank whose weights hold NaN or
Inf (an optimizer step taken on non-finite gradients) sends NaN chunks instead, and it
and its ring neighbours raise :class:`~commlib.base.errors.NonFiniteError` naming it before
any replica or weight is updated. A step that ``torch.amp.GradScaler`` skipped leaves the
weights finite.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..base.errors import NonFiniteError
from ..primitives import allgather, compressed_ring_exchange
from ..primitives.decentralized import ring_neighbors
from ..primitives.finite import all_finite
from . import state
from .base import WEIGHTS, Algorithm, Context
from .buckets import Bucket, pack, unpack
from .registry import register

REPLICAS = ("pub", "left", "right")


@register("low_precision_decentralized")
class LowPrecisionDecentralized(Algorithm):
    """``communication_interval``: gossip after every that many iterations.
    ``chunk_size``: elements per quantization chunk. State (:meth:`state_dict`): the
    replicas ``x_pub``, ``x_left``, ``x_right`` of every bucket (they differ per rank)."""

    exchanges = WEIGHTS
    per_rank_state = True

    def __init__(self, communication_interval: int = 1, chunk_size: int = 2048) -> None:
        if int(communication_interval) < 1:
            raise ValueError(f"low_precision_decentralized: communication_interval must be "
                             f">= 1, got {communication_interval}")
        self.communication_interval = int(communication_interval)
        self.chunk_size = int(chunk_size)
        self._replicas: list[dict[str, torch.Tensor]] = []

    def make_buckets(self, ctx: Context) -> list[Bucket]:
        """Buckets of weights, and the replicas: made at construction, right after the
        parameters were broadcast from rank 0 and before any optimizer step, so every
        replica of every rank starts from the same weights and each rank's copy of a
        neighbour equals that neighbour's ``x_pub`` from the start."""
        buckets = super().make_buckets(ctx)
        if not self._replicas:
            self._replicas = [{k: pack(b).clone() for k in REPLICAS} for b in buckets]
        return buckets

    def after_iteration(self, ctx: Context) -> None:
        if ctx.step % self.communication_interval == 0 and ctx.world_size > 1:
            ctx.run(self._exchange, ctx)

    def _exchange(self, ctx: Context) -> None:
        two = ctx.world_size == 2
        # Non-finite weights make the first bucket's message non-finite, so the neighbours
        # stop before updating any replica.
        finite = all([all_finite(pack(bucket)) for bucket in ctx.buckets])
        for bucket, rep in zip(ctx.buckets, self._replicas):
            x, pub = bucket.flat, rep["pub"]
            members = [pub, rep["left"]] if two else [pub, rep["left"], rep["right"]]
            target = torch.stack(members).mean(0) + (x - pub)
            if not finite:
                target.fill_(float("nan"))
            try:
                mine, from_left, from_right = compressed_ring_exchange(
                    target - pub, ctx.group, self.chunk_size)
            except NonFiniteError as exc:
                raise NonFiniteError(
                    f"low_precision_decentralized (rank {ctx.rank}): the weights of rank(s) "
                    f"{exc.ranks} are not finite after iteration {ctx.step} (a step "
                    f"taken on non-finite gradients?); no replica was updated") from exc
            rep["pub"] += mine
            rep["left"] += from_left
            rep["right"] += from_right
            bucket.flat.copy_(rep["pub"])
            unpack(bucket)

    def save_state(self, ctx: Context) -> dict[str, Any]:
        return {"buckets": state.bucket_layout(ctx.buckets), "replicas": self._replicas}

    def load_state(self, ctx: Context, saved: Mapping[str, Any], where: str) -> None:
        state.check_keys(where, saved, ("buckets", "replicas"))
        state.check_layout(where, saved["buckets"], ctx.buckets)
        for k, (rep, mine) in enumerate(zip(saved["replicas"], self._replicas)):
            state.check_keys(f"{where}: bucket {k}", rep, REPLICAS)
            for key in REPLICAS:
                state.check_tensor(where, f"replica {key!r} of bucket {k}", rep[key], mine[key])
        for rep, mine in zip(saved["replicas"], self._replicas):
            for key in REPLICAS:
                state.copy_into(mine[key], rep[key])

    def regroup(self, saved_rank: int, saved_world_size: int) -> None:
        """The copies of the neighbours' weights become those of the current ring's
        neighbours (after a shrink some neighbours are others): every rank's ``x_pub``,
        gathered at full precision (one allgather of the weights per bucket)."""
        ctx = self._context("regroup")
        left, right = ring_neighbors(ctx.rank, ctx.world_size)
        for rep in self._replicas:
            every = allgather(rep["pub"], group=ctx.group)
            state.copy_into(rep["left"], every[left])
            state.copy_into(rep["right"], every[right])
