"""``async_model_average``: weights averaged in the background while training continues.

For ``warmup_steps`` iterations the algorithm behaves as ``gradient_allreduce``; then
gradients are no longer exchanged and a :class:`~commlib.primitives.BackgroundAverager`
averages the weights every ``sync_interval_ms`` on its own communicator. A round snapshots
the weights, averages the snapshot over all ranks and queues ``average - snapshot``; the
queued correction is added to the weights before the next forward pass (never between a
forward and its backward, whose graph holds the weights), so local steps taken meanwhile
are kept. Snapshots include the queued correction and never interleave with an optimizer
step (the averager's hold, taken before the step and released after it; if the step
raises, the hold is released by the next forward, step, ``average_parameters()``,
``abort()``, close or exit, so nothing deadlocks). ``abort()`` stops the background
averaging on every rank after the current round (no thread and no request left);
``resume()`` (called on every rank) starts it again. A script that ends without closing
the wrapper stops it the same way at exit, before MPI is finalized.

``DistributedDataParallel.average_parameters()`` folds the queued correction into the
weights, averages them and drops the corrections of every round snapshotted before the
average was complete (see the averager's epochs): afterwards every rank holds bitwise the
same weights, also after the next forward.

**Rounds in steps** (``sync_every_steps=N``, instead of ``sync_interval_ms``): no
background thread and no clock, so the trajectory is deterministic and resumable exactly.
After every ``N``-th iteration of the background phase (in ``after_iteration``) the
weights are snapshotted and their average launched on the communication thread; it
overlaps the next iteration's forward, backward and optimizer step and is applied
(``average - snapshot`` added to the weights) after that iteration, before the round due
then is launched. One weight allreduce per ``N`` iterations: ``1/N`` of
``gradient_allreduce``'s bytes, the same rounds on every rank. A non-finite average is
never applied: every rank raises :class:`~commlib.base.errors.NonFiniteError` naming the ranks
whose weights are not finite.

Non-finite values (``sync_interval_ms``): a round whose average is not finite is never applied; averaging stops
on every rank and the next forward raises :class:`~commlib.base.errors.NonFiniteError` naming
the ranks. A step skipped on one rank (``torch.amp.GradScaler`` found a non-finite
gradient there) leaves that rank's weights finite and needs nothing from the others.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..base.errors import NonFiniteError
from ..base.reduce_ops import ReduceOp
from ..primitives import allreduce
from ..primitives.background import BackgroundAverager
from ..primitives.finite import all_finite, nonfinite_ranks
from . import state
from .base import GRADIENTS, WEIGHTS, Algorithm, Context
from .buckets import Bucket, build, pack
from .registry import register


@register("async_model_average")
class AsyncModelAverage(Algorithm):
    """``sync_interval_ms``: pause between background rounds (default 50), or
    ``sync_every_steps``: one round per that many iterations, deterministic (module
    docstring; give one of the two). ``warmup_steps``: iterations of synchronous gradient
    averaging first (0: background averaging from the start).
    State (:meth:`state_dict`): the correction queued for the next forward (per rank);
    the phase follows from the iteration count. Rounds in flight when the state is taken
    are not part of it, so a resumed run restores exactly what was saved but, as any run
    of this algorithm, depends on the timing of the background rounds."""

    per_rank_state = True

    def __init__(self, sync_interval_ms: float | None = None, warmup_steps: int = 0,
                 sync_every_steps: int | None = None) -> None:
        if sync_interval_ms is not None and sync_every_steps is not None:
            raise ValueError(f"async_model_average: give sync_interval_ms or "
                             f"sync_every_steps, not both (got {sync_interval_ms}, "
                             f"{sync_every_steps})")
        if sync_every_steps is not None and (isinstance(sync_every_steps, bool) or
                                             int(sync_every_steps) != sync_every_steps or
                                             sync_every_steps < 1):
            raise ValueError(f"async_model_average: sync_every_steps must be an int >= 1, "
                             f"got {sync_every_steps!r}")
        if sync_interval_ms is None:
            sync_interval_ms = 50.0
        if sync_interval_ms < 0 or warmup_steps < 0:
            raise ValueError(f"async_model_average: sync_interval_ms and warmup_steps must be "
                             f">= 0, got {sync_interval_ms}, {warmup_steps}")
        self.sync_every_steps = None if sync_every_steps is None else int(sync_every_steps)
        self._inflight: tuple[int, torch.Tensor, Any] | None = None  # (step, snapshot, job)
        self._steps_rounds = 0
        self._pending_round = False  # a loaded queue holds a round not yet applied
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
        if self.sync_every_steps is not None:
            return
        self._averager = BackgroundAverager(self._snapshot, self._apply,
                                            self.sync_interval_ms / 1e3, group=ctx.group)
        self._averager.start()

    # -- rounds in steps -------------------------------------------------------------------
    def after_iteration(self, ctx: Context) -> None:
        """Rounds in steps: keyed on ``ctx.step`` alone (not on the phase switch, which a
        resumed run makes only at its first forward), so a resumed run does the same."""
        if self.sync_every_steps is None or ctx.step <= self.warmup_steps:
            return
        if not self._weights:
            params = [(n, p) for n, p in ctx.named_parameters if p.requires_grad]
            self._weights = build(params, cap_bytes=1 << 62)
        self._settle(ctx)
        if (ctx.step - self.warmup_steps) % self.sync_every_steps == 0:
            flat = torch.cat([pack(b) for b in self._weights])
            avg = flat.clone()
            self._inflight = (ctx.step, flat, ctx.submit(_average, avg, ctx.group))

    def _settle(self, ctx: Context) -> None:
        """Finish the round in flight: its correction into ``_queued``, then into the
        weights (main thread, between iterations)."""
        if self._inflight is not None:
            step, snapshot, job = self._inflight
            self._inflight = None
            avg = job.result()
            if not all_finite(avg):
                own = all(all_finite(p) for b in self._weights for p in b.tensors)
                raise NonFiniteError(
                    f"async_model_average (rank {ctx.rank}): the weights of rank(s) "
                    f"{nonfinite_ranks(own, ctx.group)} are not finite at iteration {step}; "
                    f"the average was not applied")
            if self._queued is None:
                self._queued = torch.zeros_like(avg)
            self._queued.add_(avg.sub_(snapshot))
            self._steps_rounds += 1
        elif self._pending_round:
            self._steps_rounds += 1
        self._pending_round = False
        self._fold_queued()

    def _snapshot(self) -> torch.Tensor:
        """Background thread, under the lock: weights plus the queued correction."""
        flat = torch.cat([pack(b) for b in self._weights])
        if self._queued is None:
            self._queued = torch.zeros_like(flat)
        return flat.add_(self._queued)

    def _apply(self, delta: torch.Tensor) -> None:
        """Background thread, under the lock: queue the correction for the next forward
        (the averager drops corrections of rounds older than average_parameters())."""
        self._queued.add_(delta)

    def _fold_queued(self) -> None:
        """Main thread, under the lock: add the queued correction to the weights."""
        if self._queued is None:
            return
        with torch.no_grad():
            offset = 0
            for bucket in self._weights:
                for p in bucket.tensors:
                    p.add_(self._queued[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
            self._queued.zero_()

    def before_forward(self, ctx: Context) -> None:
        if self._averager is None:
            return
        self._averager.release()  # left by an optimizer step that raised
        self._averager.check()
        with self._averager.lock:
            self._fold_queued()

    def before_optimizer_step(self, ctx: Context, optimizer: Any) -> None:
        if self._averager is not None:
            self._averager.hold()

    def after_optimizer_step(self, ctx: Context, optimizer: Any) -> None:
        if self._averager is not None:
            self._averager.release()

    @contextlib.contextmanager
    def parameters_averaging(self, ctx: Context) -> Iterator[None]:
        """Fold the queued correction into the weights before they are averaged; drop
        every correction of a round snapshotted before the average is complete. The lock
        is held only around that bookkeeping, not across the collective, so background
        rounds (and a stop agreement at exit) go on meanwhile; their snapshots may see
        half-averaged weights, which is why their corrections are dropped."""
        averager = self._averager
        if averager is None:
            if self.sync_every_steps is not None and self._weights:
                self._settle(ctx)
            yield
            return
        averager.release()  # left by an optimizer step that raised
        with averager.lock:
            self._fold_queued()
            averager.new_epoch()
        try:
            yield
        finally:
            with averager.lock:
                averager.new_epoch()
                if self._queued is not None:
                    self._queued.zero_()  # corrections applied during the average

    @property
    def rounds(self) -> int:
        """Averaging rounds completed (applied) on this rank."""
        if self.sync_every_steps is not None:
            return self._steps_rounds
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
        if self.sync_every_steps is not None:  # the round in flight becomes the queue
            if self._inflight is not None:
                step, snapshot, job = self._inflight
                avg = job.result()
                self._inflight = (step, snapshot, _Done(avg))
                # the arithmetic of _settle, on copies
                queued = (torch.zeros_like(avg) if self._queued is None
                          else self._queued.clone())
                queued.add_(avg.clone().sub_(snapshot))
            else:
                queued = None if self._queued is None else self._queued.clone()
            return {"queued": queued, "rounds": self._steps_rounds,
                    "pending": self._inflight is not None or self._pending_round}
        if self._averager is None:
            return {"queued": self._queued}
        self._averager.release()  # left by an optimizer step that raised
        with self._averager.lock:  # a round may be applying its correction
            return {"queued": None if self._queued is None else self._queued.clone()}

    def load_state(self, ctx: Context, saved: Mapping[str, Any], where: str) -> None:
        steps = self.sync_every_steps is not None
        state.check_keys(where, saved, ("queued", "rounds", "pending") if steps
                         else ("queued",))
        queued = saved["queued"]
        if steps:
            self._inflight = None
            self._steps_rounds = int(saved["rounds"])
            self._pending_round = bool(saved["pending"])
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
        if self._inflight is not None:  # no request left behind
            job, self._inflight = self._inflight[2], None
            job.result()
        if self._averager is not None:
            averager, self._averager = self._averager, None
            averager.close()


def _average(flat: torch.Tensor, group: Any) -> torch.Tensor:
    """Communication thread: ``flat`` averaged over ``group`` in place."""
    allreduce(flat, op=ReduceOp.AVG, group=group)
    return flat


class _Done:
    """A finished job's result, as the future it replaces."""

    def __init__(self, value: torch.Tensor) -> None:
        self._value = value

    def result(self) -> torch.Tensor:
        return self._value
