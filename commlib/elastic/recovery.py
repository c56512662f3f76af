"""Recovery of :class:`commlib.elastic.State` after a shrink: what each survivor brings to
the agreement on the step (its last commit, and whether it can restore it), and bringing
every member to the agreed commit: its own copy, a broadcast from a holder, a transfer to
members without state, ZeRO's lost shards rebuilt from their replicas."""
from __future__ import annotations

import copy
from typing import Any

import torch

from ..base.errors import CommError
from . import zero as zero_elastic
from .policies import PER_RANK, SYNCED

#: Test hook: recover without the survivors' step agreement (each rank goes on from its own
#: last commit). Wrong on purpose, for the negative control of the tests.
_SKIP_AGREEMENT = False


class _Recovery:
    """:class:`~commlib.elastic.State`'s recovery (a mixin; :func:`commlib.elastic.run`
    calls it)."""

    def _value(self) -> tuple[int, bool]:
        """What this rank brings to the agreement: its last commit's step, and whether it
        can restore that commit (its live state is it, or it holds a copy)."""
        if self._empty:  # a joining spare before its state arrived: nothing to restore
            return (-1, False)
        last = self._commits[-1]
        if (self._ring is not None and len(self._commits) > 1
                and not self._ring.received(last.optimizer)):
            # ZeRO: the replica of the last commit did not arrive (see zero.Ring)
            return (self._commits[-2].step, self._commits[-2].full)
        clean = self._clean and self._optimizer_steps == self._steps_at_commit
        return (last.step, bool(clean or last.full))

    def _restore(self, group: Any, old_size: int) -> None:
        """After the shrink to ``group`` (whose ``agreement`` holds every member's
        :meth:`_value`; the state's group from now on): bring every member to the agreed
        commit. ``old_size``: the group's size before the failure (``scale_lr``)."""
        d = self.__dict__
        fence = d.get("_pending_fence")
        if fence is not None:   # the old group's: given up on (it may never complete)
            fence._comm.abandon(fence)
            d["_pending_fence"] = None
        if self._ring is not None:  # (its buffers are MPI's now: the commit is dropped)
            self._ring.abandon()
        d["group"] = group
        decision = group.agreement
        mine = self._value()
        # members without any state (spares whose joining the failure interrupted, value
        # (-1, False)) take no part in choosing the commit; they receive it at the end
        held = {r: v for r, v in decision.values.items() if v[0] >= 0}
        empty = [i for i, r in enumerate(decision.members) if r not in held]
        if not held:
            raise CommError(f"commlib.elastic (rank {group.rank}): none of the survivors "
                            f"{list(decision.members)} holds the state (only spares that "
                            f"had not received it yet survived)")
        if _SKIP_AGREEMENT:
            self._restore_own(mine[0])
        elif self.policy == PER_RANK:
            if not self._empty:
                self._restore_own(min(held.values())[0])
        else:
            top = max(held.values())
            holder = next(r for r in decision.members if held.get(r) == top)
            if not top[1]:
                raise CommError(f"commlib.elastic (rank {group.rank}): no survivor can "
                                f"restore step {top[0]} (their state moved past their last "
                                f"commit without a copy: commit after each optimizer step)")
            if mine == top:
                self._restore_own(top[0])
            if any(v != top for v in decision.values.values()):
                # SYNCED: the models (and algorithm states) are equal at an average or
                # outer step, the optimizers never are (weights only are averaged): each
                # member keeps its own; one that missed the average has it live (it
                # stepped up to it: checked). A member without state takes it all.
                own = self.policy == SYNCED and not self._empty
                ahead = self._optimizer_steps - self._steps_at_commit
                if own and mine != top and ahead != top[0] - mine[0]:
                    raise CommError(
                        f"commlib.elastic (rank {group.rank}): the survivors agreed on the "
                        f"average of step {top[0]}, which this rank missed, but its "
                        f"optimizer is not at that step ({ahead} steps after its commit "
                        f"of step {mine[0]})")
                self._receive(group, decision.members.index(holder), optimizer=not own)
                empty = []  # (the broadcast reached them too)
        if zero_elastic.is_zero(self.optimizer):  # the lost shards from their replicas
            snap = self._commits[-1]
            snap.optimizer = zero_elastic.rebuild(self.optimizer, group, snap.optimizer)
        if empty:  # per rank: each from one member that restored (all hold the commit)
            olds = [i for i in range(group.size) if i not in empty]
            self._transfer(group, {j: olds[k % len(olds)] for k, j in enumerate(empty)})
        d["recoveries"].append({"size": group.size, "members": list(group.ranks),
                                "values": dict(decision.values), "step": self.step})
        if self.scale_lr and self.optimizer is not None and old_size != group.size:
            for param_group in self.optimizer.param_groups:
                param_group["lr"] *= group.size / old_size

    def _restore_own(self, step: int) -> None:
        commits = [c for c in self._commits if c.step == step]
        if not commits:
            have = [c.step for c in self._commits]
            raise CommError(f"commlib.elastic: the survivors agreed on step {step}, but this "
                            f"rank keeps only the commits of steps {have} (raise State.keep)")
        snap = commits[-1]
        d = self.__dict__
        if snap.full:
            with torch.no_grad():
                self.model.load_state_dict(snap.model)
            # (a ZeRO optimizer takes its state in the rebuild that follows, see _restore)
            if self.optimizer is not None and not zero_elastic.is_zero(self.optimizer):
                self.optimizer.load_state_dict(copy.deepcopy(snap.optimizer))
            d["_algorithm_state"] = snap.algorithm
        elif not (self._clean and self._optimizer_steps == self._steps_at_commit):
            raise CommError(f"commlib.elastic: this rank's state moved past step {step} and "
                            f"no copy was kept")
        d["step"] = step
        d["values"] = copy.deepcopy(snap.values)
        d["_commits"] = [c for c in self._commits if c.step <= step]
        d["_steps_at_commit"] = self._optimizer_steps
        d["_clean"] = True
