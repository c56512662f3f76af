"""``decentralized``: decentralized SGD (D-PSGD); weights averaged with peers, no gradient
exchange.

At a communicating step ``t`` every rank snapshots its weights ``x_t`` before the forward
pass and averages the snapshot with its peers on the communication thread while forward
and backward run; before the optimizer step the weights become the averaged snapshot, and
the optimizer then applies the local gradient: ``x_{t+1} = avg_peers(x_t) - lr * g_i(x_t)``.
Communication thus overlaps the whole forward/backward. Replicas differ during training
(they only agree under ``"all"``); ``DistributedDataParallel.average_parameters()`` makes
them equal, e.g. before evaluation.

Non-finite weights are never averaged into the replicas: when an averaged snapshot holds
NaN or Inf (some rank took a step on non-finite gradients), every rank that received it
(every rank under ``"all"``, the pair under ``"shift_one"``) raises
:class:`~commlib.base.errors.NonFiniteError` naming the rank, and keeps its own weights.
"""
from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch

from ..base.errors import NonFiniteError
from ..primitives import PEER_MODES, peer_average, shift_one_peer
from ..primitives.finite import all_finite, nonfinite_ranks
from . import state
from .base import WEIGHTS, Algorithm, Context
from .buckets import pack, unpack
from .registry import register


@register("decentralized")
class Decentralized(Algorithm):
    """``peer_selection_mode``: ``"all"`` (average with every rank) or ``"shift_one"`` (one
    peer per step, pairs disjoint, the peer changing every step; see
    :func:`commlib.primitives.shift_one_peer`). ``communication_interval``: communicate
    every that many iterations (local steps in between)."""

    exchanges = WEIGHTS

    def __init__(self, peer_selection_mode: str = "all", communication_interval: int = 1):
        if peer_selection_mode not in PEER_MODES:
            raise ValueError(f"decentralized: peer_selection_mode must be one of "
                             f"{PEER_MODES}, got {peer_selection_mode!r}")
        if int(communication_interval) < 1:
            raise ValueError(f"decentralized: communication_interval must be >= 1, "
                             f"got {communication_interval}")
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = int(communication_interval)
        self._pending: Future | None = None
        self._snapshot_step = -1

    def before_forward(self, ctx: Context) -> None:
        step = ctx.step
        if step % self.communication_interval or self._snapshot_step == step:
            return
        self._snapshot_step = step
        flats = [pack(b) for b in ctx.buckets]
        self._pending = ctx.submit(self._exchange, ctx, flats, step)

    def _exchange(self, ctx: Context, flats: list[torch.Tensor], step: int) -> None:
        round_ = step // self.communication_interval
        for bucket, flat in zip(ctx.buckets, flats):
            peer_average(flat, self.peer_selection_mode, round_, group=ctx.group)
            if not all_finite(flat):  # seen by every rank that averaged with the bad one
                self._non_finite(ctx, bucket, round_)

    def _non_finite(self, ctx: Context, bucket: Any, round_: int) -> None:
        own = all(all_finite(t) for t in bucket.tensors)  # not yet overwritten
        if self.peer_selection_mode == "all":
            bad = nonfinite_ranks(own, ctx.group)
        else:
            bad = [ctx.rank] if not own else [shift_one_peer(ctx.rank, ctx.world_size, round_)]
        raise NonFiniteError(f"decentralized (rank {ctx.rank}): the weights of rank(s) {bad} "
                             f"are not finite at iteration {ctx.step} (a step taken on "
                             f"non-finite gradients?); the average was not applied")

    def before_optimizer_step(self, ctx: Context, optimizer: Any) -> None:
        self._finish(ctx)

    def after_iteration(self, ctx: Context) -> None:
        # A rank whose optimizer skipped the step (AMP overflow) still takes the average.
        self._finish(ctx)

    def _finish(self, ctx: Context) -> None:
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.result()
        for bucket in ctx.buckets:
            unpack(bucket)

    def teardown(self, ctx: Context) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def save_state(self, ctx: Context) -> dict[str, Any]:
        """The iteration whose weights were last snapshotted (a second forward of the same
        iteration, e.g. under ``no_sync``, does not exchange again). The weights are the
        model's own."""
        if self._pending is not None:
            raise RuntimeError(f"decentralized.state_dict (rank {ctx.rank}): an exchange is in "
                               f"flight; take the state between iterations (after "
                               f"optimizer.step())")
        return {"snapshot_step": self._snapshot_step}

    def load_state(self, ctx: Context, saved: Mapping[str, Any], where: str) -> None:
        state.check_keys(where, saved, ("snapshot_step",))
        self._snapshot_step = int(saved["snapshot_step"])
