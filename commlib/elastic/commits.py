"""Commits of :class:`commlib.elastic.State`: counting the optimizer's steps, recording a
commit in memory (:class:`_Snapshot`: the step, the user's values and, when kept, copies
of the model, optimizer and algorithm state), the fence that keeps per-rank replicas
within ``keep`` commits of each other, and the commit a synced algorithm takes where its
replicas meet (:func:`_commit_after_average`). Rank-local: nothing here communicates but
the fence's non-blocking barrier and ZeRO's replica exchange."""
from __future__ import annotations

import copy
from typing import Any

from ..ddp.replicas import per_rank_state
from . import zero as zero_elastic
from .commit_buffers import copy_tree


class _Snapshot:
    """A commit: the step, the user's values and, when kept, copies of the model, the
    optimizer and the algorithm state."""

    def __init__(self, step: int, values: dict, model: Any = None, optimizer: Any = None,
                 algorithm: Any = None) -> None:
        self.step, self.values = step, values
        self.model, self.optimizer, self.algorithm = model, optimizer, algorithm

    @property
    def full(self) -> bool:
        return self.model is not None


class _Commits:
    """:class:`~commlib.elastic.State`'s commits (a mixin: the state is in its
    ``__dict__``, see :class:`~commlib.elastic.State`)."""

    def _counted(self, *args: Any) -> None:
        self.__dict__["_optimizer_steps"] += 1

    def _fence_due(self) -> bool:
        """Bound how far the replicas of a per-rank algorithm drift apart in commits, so
        that the survivors always hold a common one. ``decentralized`` exchanges with one
        peer per step, so nothing else holds ranks together: after a death, a rank whose
        peers finished their exchanges (a survivor told of the failure gives up its own
        wait at once) can run several steps past one that stopped (seen: commits [12, 13]
        against 11 with ``keep=2``). At every ``K``-th commit (``K = keep // 2``), before
        recording it, each rank waits for the non-blocking barrier it started at the
        previous fence, ``K`` commits earlier, after recording that commit; it starts the
        next one after recording this one (:meth:`_fence_wait`, then :meth:`commit`):
        when a rank records
        commit ``c``, every rank has recorded ``c - 2K + 1`` or later, which the
        ``keep >= 2K`` commits it holds include. One barrier per ``K`` commits, overlapped
        with ``K`` commits of training (``keep=2``: one per step, waited a step later); a
        failure meanwhile shows here as in any collective."""
        return (self.step // self.commit_every) % max(1, self.keep // 2) == 0

    def _fence_wait(self) -> None:
        d = self.__dict__
        pending, d["_pending_fence"] = d.get("_pending_fence"), None
        if pending is not None:
            pending.wait()

    def _settle(self) -> None:
        """Wait for the pending fence and replica exchange (training over on every
        member: each started the same)."""
        self._fence_wait()
        if self._ring is not None:
            self._ring.wait()

    def _record(self, full: bool, step: int | None = None, values: dict | None = None) -> None:
        d = self.__dict__
        snap = _Snapshot(self.step if step is None else step,
                         copy.deepcopy(self.values) if values is None else values)
        commits = d["_commits"]
        # the commit that falls out: its copies' tensors take this one's (in place)
        old = commits[0] if len(commits) >= self.keep and commits[0].full else None
        if full:
            # ZeRO first: its exchange with the neighbours starts while the ranks are
            # still in step (right after the optimizer's all-gather)
            if zero_elastic.is_zero(self.optimizer):  # own shard, replica of the previous
                snap.optimizer = zero_elastic.commit(self.optimizer, self._ring,
                                                     old and old.optimizer)
                d["replica_bytes"] = snap.optimizer["replica_bytes"]
            else:
                snap.optimizer = (copy_tree(self.optimizer.state_dict(),
                                            old and old.optimizer)
                                  if self.optimizer is not None else None)
            with per_rank_state():  # each rank's own replica, on purpose
                snap.model = copy_tree(self.model.state_dict(), old and old.model)
            # (no wrapper yet, e.g. a spare that just received the state: what it holds)
            snap.algorithm = (self._wrapper.algorithm.state_dict()
                              if self._wrapper is not None
                              else getattr(self, "_algorithm_state", None))
        commits.append(snap)
        del commits[:-self.keep]
        d["_steps_at_commit"] = self._optimizer_steps
        d["_clean"] = True


def _commit_after_average(state: _Commits, wrapper: Any) -> None:
    """``SYNCED``: take the commit right after each iteration's ``after_iteration`` where
    the algorithm says its replicas meet (``synced_at``: ``local_sgd``'s averages,
    ``diloco``'s outer steps)."""
    algorithm = wrapper.algorithm
    original = type(algorithm).after_iteration

    def after_iteration(ctx: Any) -> None:
        original(algorithm, ctx)
        if algorithm.synced_at(ctx.step):
            pending = state.__dict__.get("_pending_values")
            values = pending[1] if pending is not None and pending[0] == ctx.step else None
            state._record(full=True, step=ctx.step, values=values)

    algorithm.after_iteration = after_iteration
