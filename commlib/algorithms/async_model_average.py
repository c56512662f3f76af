"""``async_model_average``: weights averaged in the background while training continues.

For ``warmup_steps`` iterations the algorithm behaves as ``gradient_allreduce``; then
gradients are no longer exchanged and a :class:`~commlib.primitives.BackgroundAverager`
averages the weights every ``sync_interval_ms`` on its own communicator. A round snapshots
the weights, averages the snapshot over all ranks and queues ``average - snapshot``; the
queued correction is added to the weights before the next forward pass (never between a
forward and its backward, whose graph holds the weights), so local steps taken meanwhile
are kept. Snapshots include the queued correction and never interleave with an optimizer
step (a lock). ``abort()`` stops the background averaging on every rank
after the current round (no thread and no request left); ``resume()`` (called on every
rank) starts it again.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ..primitives import allreduce
from ..primitives.background import BackgroundAverager
from ..reduce_ops import ReduceOp
from . import state
from .base import GRADIENTS, WEIGHTS, Algorithm, Context
from .buckets import Bucket, build, pack
from .registry import register


@register("async_model_average")
class AsyncModelAverage(Algorithm):
    """``sync_interval_ms``: pause between background rounds. ``warmup_steps``: iterations
    of synchronous gradient averaging first (0: background averaging from the start).
    State (:meth:`state_dict`): the correction queued for the next forward (per rank);
    the phase follows from the iteration count. Rounds in flight when the state is taken
    are not part of it, so a resumed run restores exactly what was saved but, as any run
    of this algorithm, depends on the timing of the background rounds."""

    per_rank_state = True

    def __init__(self, sync_interval_ms: float = 50.0, warmup_steps: int = 0) -> None:
        if sync_interval_ms < 0 or warmup_steps < 0:
            raise ValueError(f"async_model_average: sync_interval_ms and warmup_steps must be "
                             f">= 0, got {sync_interval_ms}, {warmup_steps}")
        self.sync_interval_ms = float(sync_interval_ms)
        self.warmup_steps = int(warmup_steps)
        self.exchanges = GRADIENTS if self.warmup_steps > 0 else WEIGHTS
        self._averager: BackgroundAverager | None = None
        self._weights: list[Bucket] = []
        self._queued: torch.Tensor | None = None

    # -- warm-up: synchronous gradient averaging ---------------------------------------
    def on_bucket_ready(self, ctx: Context, bucket: Bucket) -> Any:
        return allreduce(bucket.flat, op=ReduceOp.AVG, group=ctx.group, async_op=True)

    def need_reset(self, ctx: Context) -> bool:
        return self.exchanges == GRADIENTS and ctx.step >= self.warmup_steps

    def reset(self, ctx: Context) -> None:
        self.exchanges = WEIGHTS
        self._start(ctx)

    def setup(self, ctx: Context) -> None:
        if self.exchanges == WEIGHTS:
            self._start(ctx)

    # -- background phase -------------------------------------------------------------
    def _start(self, ctx: Context) -> None:
        params = [(n, p) for n, p in ctx.named_parameters if p.requires_grad]
        self._weights = build(params, cap_bytes=1 << 62)
        self._averager = BackgroundAverager(self._snapshot, self._apply,
                                            self.sync_interval_ms / 1e3, group=ctx.group)
        self._averager.start()

    def _snapshot(self) -> torch.Tensor:
        """Background thread, under the lock: weights plus the queued correction."""
        flat = torch.cat([pack(b) for b in self._weights])
        if self._queued is None:
            self._queued = torch.zeros_like(flat)
        return flat.add_(self._queued)

    def _apply(self, delta: torch.Tensor) -> None:
        """Background thread, under the lock: queue the correction for the next forward."""
        self._queued.add_(delta)

    def before_forward(self, ctx: Context) -> None:
        if self._averager is None or self._queued is None:
            return
        with self._averager.lock, torch.no_grad():
            offset = 0
            for bucket in self._weights:
                for p in bucket.tensors:
                    p.add_(self._queued[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
            self._queued.zero_()

    def before_optimizer_step(self, ctx: Context, optimizer: Any) -> None:
        if self._averager is not None:
            self._averager.lock.acquire()

    def after_optimizer_step(self, ctx: Context, optimizer: Any) -> None:
        if self._averager is not None and self._averager.lock.locked():
            self._averager.lock.release()

    @property
    def rounds(self) -> int:
        """Background averaging rounds completed on this rank."""
        return self._averager.rounds if self._averager is not None else 0

    def abort(self) -> None:
        """Stop background averaging on every rank after the current round; returns once
        this rank's averaging thread has ended."""
        if self._averager is not None:
            self._averager.stop()

    def resume(self) -> None:
        """Start background averaging again (call on every rank)."""
        if self._averager is not None:
            self._averager.start()

    def save_state(self, ctx: Context) -> dict[str, Any]:
        if self._averager is None:
            return {"queued": self._queued}
        with self._averager.lock:  # a round may be applying its correction
            return {"queued": None if self._queued is None else self._queued.clone()}

    def load_state(self, ctx: Context, saved: Mapping[str, Any], where: str) -> None:
        state.check_keys(where, saved, ("queued",))
        queued = saved["queued"]
        params = [p for _, p in ctx.named_parameters if p.requires_grad]
        if queued is not None:
            state.check_tensor(where, "the queued correction", queued,
                               (sum(p.numel() for p in params),), params[0].dtype)
            queued = state.restore(queued, params[0].device)
        running = self._averager is not None and self._averager.running
        if running:  # no round snapshotted before the load may apply after it
            self._averager.stop()
        self._queued = queued
        if running:
            self._averager.start()

    def teardown(self, ctx: Context) -> None:
        if self._averager is not None:
            self._averager.close()
            self._averager = None
