"""``commlib.elastic.State``: what training needs to go on after a failure, committed in
memory, restored on the survivors, sent to the ranks that lack it."""
from __future__ import annotations

import copy
import io
from typing import Any

import numpy as np
import torch

from ..base.errors import CommError
from ..ddp.replicas import per_rank_state
from ..primitives import broadcast, world
from . import transfer
from . import zero as zero_elastic
from .commit_buffers import copy_tree

# How each algorithm's state survives a failure (see the State docstring).
REPLICATED = "replicated"      # every replica holds the same state at a commit
PER_RANK = "per_rank"          # replicas differ: each restores its own snapshot
SYNCED = "synced"              # replicas equal where the algorithm says (synced_at) only
POLICIES = {"gradient_allreduce": REPLICATED, "bytegrad": REPLICATED,
            "decentralized": PER_RANK, "local_sgd": SYNCED, "diloco": SYNCED,
            "streaming_diloco": PER_RANK, "powersgd": PER_RANK,
            "low_precision_decentralized": PER_RANK, "qadam": PER_RANK,
            "sparseloco": PER_RANK, "muloco": PER_RANK, "demo": PER_RANK}
UNSUPPORTED = {
    "async_model_average": "its background rounds are not tied to steps, so no step can be "
                           "agreed",
    "d_kfac": "its layer assignment and factors are tied to the world size",
    "dp_kfac": "its layer assignment and factors are tied to the world size",
}
#: Tag of the point-to-point state transfers (:meth:`State._transfer`).
TRANSFER_TAG = 34
#: Test hook: recover without the survivors' step agreement (each rank goes on from its own
#: last commit). Wrong on purpose, for the negative control of the tests.
_SKIP_AGREEMENT = False


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


class State:
    """Training state that survives the death of ranks (:func:`commlib.elastic.run`).

    ``model`` (a ``torch.nn.Module``, the one to wrap), ``optimizer`` (a ``torch.optim``
    optimizer of its parameters), ``sampler`` (an :class:`ElasticSampler`, bound to this
    state) and any user values given as keywords (``epoch=0``...: read and written as
    attributes, e.g. ``state.epoch``; picklable). ``group`` is the group training runs on
    (the world, then the survivors' group), ``step`` the steps committed.

    Call :meth:`commit` after each optimizer step: it counts the step and, every
    ``commit_every`` steps, records a commit in memory (rank-local, never communicates).
    What a commit copies depends on the algorithm of the wrapper made by :meth:`wrap`:

    * replicated state (``gradient_allreduce``, ``bytegrad``): with ``commit_every=1``
      nothing is copied: every survivor holds the state of its last commit, and survivors
      that are one step behind (one finished the step's exchange just before the death,
      another did not) receive it by broadcast from one that holds it. Otherwise the model,
      optimizer and algorithm state are copied at each commit and restored.
    * per rank (``decentralized``, ``low_precision_decentralized``, ``streaming_diloco``,
      ``powersgd``, ``qadam``, ``sparseloco``, ``muloco``, ``demo``: replicas or
      algorithm states differ): each commit copies
      this rank's model, optimizer and algorithm state; the last ``keep`` commits are
      kept. The survivors agree on the earliest last commit among them and each restores
      its own copy of it. A non-blocking barrier every ``keep // 2`` commits keeps every
      rank within ``keep - 1`` commits of the others, so that commit is always held (see
      :meth:`_fence_due`). ``streaming_diloco``: its fragments meet the global weights at
      staggered steps, never all at once, so no step has equal replicas to commit at; the
      commit holds the global weights and outer momentum, the error-feedback residuals
      and an exchange in flight (the commit waits for it). ``powersgd``: its residuals
      (of this rank's gradient), the P and Q memories and the random generator (the same
      on every rank); none is shaped by the world size, so a smaller group takes them as
      they are. ``low_precision_decentralized``: its replicas ``x_pub``, ``x_left``,
      ``x_right``; the copies of the neighbours are rebuilt for the new ring when the
      survivors' wrapper loads them
      (:meth:`~commlib.algorithms.Algorithm.regroup`). ``qadam``: the momentum and
      frozen denominators (the same on every rank) and the residuals, whose server part
      (of this rank's share in the old group) is dropped in a new group.
      ``sparseloco``, ``muloco`` (DiLoCo's outer loop with per-rank error feedback) and
      ``demo`` (each rank's momentum, with what it has not sent yet): the global weights
      (the same on every rank; ``muloco``'s outer momentum too), this rank's replica, its
      inner optimizer and its error feedback, as of the end of the committed step (an
      outer step due at that step is not applied yet: after a recovery it is taken over
      the survivors). Unlike ``diloco`` the partial round is kept (the error feedback is
      each rank's own, so no step has every rank's state equal to commit at). Each
      survivor restores its own error feedback; the dead rank's, what it had not sent
      yet, is lost with it, and the survivors' next exchange averages over the survivors
      alone. A rank that takes another rank's state (a joining spare, a replacement)
      starts with zero error feedback (no momentum for ``demo``), as a fresh rank does
      (:meth:`~commlib.algorithms.Algorithm.reset_own_state`): a copy would send the
      other rank's unsent residual twice.
    * ``local_sgd`` and ``diloco``: a commit is taken where the algorithm's replicas meet
      (:meth:`~commlib.algorithms.Algorithm.synced_at`: after each average, after each
      outer step, every ``sync_every``-th step), right after it is applied: the model, the
      optimizer and the algorithm state (``diloco``: the global weights and the outer
      momentum, the same on every rank) are copied. A failure discards the partial round
      (the local or inner steps since), as torchft's DiLoCo does. A survivor that missed
      the agreed average or outer step receives the model and the algorithm state, and
      keeps its own optimizer state (never averaged: each replica's momentum, or inner
      optimizer state, is its own).

    ``scale_lr``: after a shrink multiply each parameter group's ``lr`` by
    ``new size / old size`` (for jobs whose per-rank batch is fixed; with
    :class:`ElasticSampler` the global batch is fixed and the learning rate stays).
    ZeRO stage 1 (``optimizer`` a :class:`~commlib.ZeroRedundancyOptimizer`, behind
    ``gradient_allreduce`` or ``bytegrad``): committed per rank, each commit also sending
    this rank's optimizer shard to the next rank (:mod:`commlib.elastic.zero`); after a
    failure the survivors rebuild the full optimizer state of the agreed commit from their
    shards and replicas and partition it again over themselves. ``replica_bytes``: the
    bytes of the shard the last commit sent.

    Unsupported (refused by :meth:`wrap`, reasons in :data:`UNSUPPORTED`):
    ``async_model_average``, ``d_kfac``, ``dp_kfac``. Refused here: FSDP and sharded
    embeddings in ``model`` (a shard of their parameters dies with its rank; no replica
    is kept), a ZeRO optimizer with ``reduce_gradients=True``; by :func:`run`: spares and
    replacements with ZeRO.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: Any = None,
                 sampler: Any = None, *, commit_every: int = 1, keep: int = 2,
                 scale_lr: bool = False, **values: Any) -> None:
        if int(commit_every) < 1 or int(keep) < 2:
            raise ValueError(f"State: need commit_every >= 1 and keep >= 2, got "
                             f"commit_every={commit_every}, keep={keep}")
        _refuse_sharded(model, optimizer)
        d = self.__dict__
        d["model"], d["optimizer"], d["sampler"] = model, optimizer, sampler
        d["commit_every"], d["keep"], d["scale_lr"] = int(commit_every), int(keep), scale_lr
        d["values"] = dict(values)
        d["step"] = 0
        d["group"] = None
        d["target_size"] = 0        # the world size to grow back to (run(replace=True))
        d["spares"] = []            # idle spares, world ranks (run(spares=K))
        d["policy"] = REPLICATED
        d["_wrapper"] = None
        d["_commits"]: list[_Snapshot] = []
        d["_optimizer_steps"] = 0   # optimizer steps taken (a post hook counts them)
        d["_steps_at_commit"] = 0
        d["_clean"] = True          # the live state is the one of the last commit
        d["recoveries"] = []        # what each recovery agreed (for logs and tests)
        d["_empty"] = False         # a spare that has not received the state yet
        d["replica_bytes"] = 0      # ZeRO: bytes of the shard sent to the next rank, last commit
        if sampler is not None and hasattr(sampler, "state"):
            sampler.state = self
        if optimizer is not None:
            optimizer.register_step_post_hook(self._counted)
        d["_ring"] = None           # ZeRO: the replica exchange in flight
        if zero_elastic.is_zero(optimizer):
            d["_ring"] = zero_elastic.Ring()
            optimizer.register_step_pre_hook(lambda *args: self._ring.wait())
        self._record(full=False)

    # -- user values as attributes -----------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"State has no attribute or value {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__ and name != "values":
            self.__dict__[name] = value
        else:
            self.values[name] = value

    # -- committing -----------------------------------------------------------------------
    def _counted(self, *args: Any) -> None:
        self.__dict__["_optimizer_steps"] += 1

    def commit(self) -> None:
        """Count one completed training step and, every ``commit_every`` steps, commit the
        state in memory (rank-local; see the class docstring). Call it after each
        ``optimizer.step()``."""
        d = self.__dict__
        d["step"] += 1
        if self.policy == SYNCED:
            d["_pending_values"] = (self.step, copy.deepcopy(self.values))
            return  # the commit is taken when the average is applied
        if self.step % self.commit_every == 0:
            full = self.policy == PER_RANK or self.commit_every > 1
            fence = self.policy == PER_RANK and self._fence_due()
            if fence:
                self._fence_wait()
            self._record(full)
            if fence:
                from ..primitives.barrier import barrier
                d["_pending_fence"] = barrier(group=self.group, async_op=True)

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

    @property
    def last_commit(self) -> int:
        """The step of the last commit."""
        return self._commits[-1].step

    # -- the wrapper --------------------------------------------------------------------
    def wrap(self, module: torch.nn.Module | None = None, **ddp_kwargs: Any) -> Any:
        """A :class:`commlib.DistributedDataParallel` of ``module`` (default: the state's
        model) over the state's group, with ``ddp_kwargs`` (``algorithm=``...). Call it at
        the start of the training function: after a failure :func:`run` closes it and calls
        the function again, which wraps the model over the survivors (parameters are not
        broadcast: the state is consistent already)."""
        from ..ddp import DistributedDataParallel
        name = ddp_kwargs.get("algorithm", "gradient_allreduce")
        name = name if isinstance(name, str) else getattr(name, "name", "?")
        if name in UNSUPPORTED:
            raise CommError(f"commlib.elastic.State.wrap: algorithm {name!r} is not supported "
                            f"in elastic training: {UNSUPPORTED[name]}")
        if name not in POLICIES:
            raise CommError(f"commlib.elastic.State.wrap: algorithm {name!r} is not known "
                            f"to commlib.elastic (supported: {sorted(POLICIES)})")
        zero = zero_elastic.is_zero(self.optimizer)
        if zero and POLICIES[name] != REPLICATED:
            raise CommError(f"commlib.elastic.State.wrap: a ZeroRedundancyOptimizer needs "
                            f"averaged gradients (gradient_allreduce, bytegrad), not "
                            f"{name!r}")
        ddp_kwargs.setdefault("init_sync", False)
        if self._wrapper is not None:
            self.close_wrapper()
        wrapper = DistributedDataParallel(module if module is not None else self.model,
                                          process_group=self.group or world(), **ddp_kwargs)
        d = self.__dict__
        d["_wrapper"] = wrapper
        # ZeRO: each rank's shard is its own (and a replica of its predecessor's)
        policy = PER_RANK if zero else POLICIES[name]
        if policy != self.policy:
            d["policy"] = policy
            self._record(full=policy != REPLICATED or self.commit_every > 1)
        algo_state = getattr(self, "_algorithm_state", None)
        if algo_state is not None:
            saved = (algo_state["rank"], algo_state["world_size"])
            algo_state = dict(algo_state, rank=wrapper.process_group.rank,
                              world_size=wrapper.process_group.size)
            wrapper.algorithm.load_state_dict(algo_state)
            # collective where it communicates (per-rank algorithms: every member of
            # the group restored a full commit, so every member loads a state here)
            wrapper.algorithm.regroup(*saved)
        if d.get("_adopted"):  # another rank's state (a joining spare, a replacement)
            wrapper.algorithm.reset_own_state()
            d["_adopted"] = False
        if policy == SYNCED:
            _commit_after_average(self, wrapper)
        return wrapper

    def close_wrapper(self) -> None:
        """Close the wrapper of :meth:`wrap` (its exchanges may have failed)."""
        wrapper, self.__dict__["_wrapper"] = self._wrapper, None
        if wrapper is not None:
            try:
                wrapper.close()
            except Exception:  # noqa: BLE001 - its communicators failed
                pass

    # -- recovery (run() calls these) ---------------------------------------------------
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

    def _receive(self, group: Any, root: int, optimizer: bool = True, keep: bool = False,
                 adopted: bool = False) -> None:
        """Collective over ``group``: everyone takes the state of member ``root`` (its
        optimizer's too, unless ``optimizer`` is false: each keeps its own), but members
        that pass ``keep`` (they hold the state already: they only take part in the
        broadcast). ``adopted``: the receivers take another rank's state as their own
        (newcomers; see :meth:`_apply`)."""
        data = self._pack() if group.rank == root else None
        takes = group.rank != root and not keep
        if takes:
            self.__dict__["_clean"] = False  # until the state arrived
        size = np.array([0 if data is None else data.size], dtype=np.int64)
        broadcast(size, root, group)
        if data is None:
            data = np.empty(int(size[0]), dtype=np.uint8)
        broadcast(data, root, group)
        if takes:
            self._unpack(data, optimizer, adopted)

    def _transfer(self, group: Any, senders: dict[int, int]) -> None:
        """Over ``group``, point to point: each member ``j`` of ``senders`` takes the
        state of member ``senders[j]`` (every sender holds the same state: the agreed
        commit), tensor by tensor (:mod:`commlib.elastic.transfer`); the other members
        only send, or do nothing. What a joining spare needs, without the survivors
        receiving what they hold."""
        me = group.rank
        mine = [j for j, src in sorted(senders.items()) if src == me]
        if mine:
            tree = self._tree()
            for j in mine:
                transfer.send(group, j, tree, TRANSFER_TAG)
        if me in senders:
            self.__dict__["_clean"] = False  # until the state arrived
            self._apply(transfer.recv(group, senders[me], TRANSFER_TAG), True, adopted=True)

    def _tree(self) -> dict:
        """This rank's state: step, values, model, optimizer, algorithm."""
        with per_rank_state():  # this rank's replica, on purpose
            model_state = self.model.state_dict()
        return {"step": self.step, "values": self.values, "target_size": self.target_size,
                "model": model_state,
                "optimizer": (self.optimizer.state_dict()
                              if self.optimizer is not None else None),
                "algorithm": getattr(self, "_algorithm_state", None)}

    def _pack(self) -> np.ndarray:
        """This rank's state (:meth:`_tree`), serialized."""
        buffer = io.BytesIO()
        torch.save(self._tree(), buffer)
        return np.frombuffer(buffer.getbuffer(), dtype=np.uint8)  # (holds the buffer)

    def _unpack(self, data: np.ndarray, optimizer: bool, adopted: bool = False) -> None:
        """Take the state of :meth:`_pack` (``optimizer`` false: keep this rank's own)."""
        self._apply(torch.load(io.BytesIO(data.tobytes()), weights_only=False), optimizer,
                    adopted)

    def _apply(self, saved: dict, optimizer: bool, adopted: bool = False) -> None:
        """Take the state ``saved`` (of :meth:`_tree`; ``optimizer`` false: keep this
        rank's own). ``adopted``: this rank had no state and takes another rank's as its
        own (a joining spare, a spawned replacement): what the algorithm keeps of that
        rank alone (error feedback) is reset when the state is next wrapped
        (:meth:`~commlib.algorithms.Algorithm.reset_own_state`)."""
        d = self.__dict__
        if adopted:
            d["_adopted"] = True
        with torch.no_grad():
            self.model.load_state_dict(saved["model"])
        if self.optimizer is not None and optimizer:
            self.optimizer.load_state_dict(saved["optimizer"])
        d["step"], d["values"] = saved["step"], saved["values"]
        d["target_size"] = saved["target_size"]
        d["_algorithm_state"] = saved["algorithm"]
        d["_empty"] = False
        self._record(full=self.policy != REPLICATED or self.commit_every > 1)

    def drop_gradients(self) -> None:
        """Forget every gradient (they may view the failed wrapper's buffers, which MPI may
        still write)."""
        if self.model is not None:
            for p in self.model.parameters():
                p.grad = None


def _commit_after_average(state: State, wrapper: Any) -> None:
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


#: Why FSDP and sharded embeddings are refused.
SHARDED_REASON = "a shard of its parameters dies with its rank (no replica is kept)"


def _refuse_sharded(model: Any, optimizer: Any) -> None:
    if isinstance(model, torch.nn.Module):
        from ..embedding.module import _ShardedBase
        from ..sharded.fsdp import FullyShardedDataParallel
        for module in model.modules():
            if isinstance(module, (FullyShardedDataParallel, _ShardedBase)):
                raise CommError(f"commlib.elastic.State: {type(module).__name__} is not "
                                f"supported: {SHARDED_REASON}")
    if zero_elastic.is_zero(optimizer) and optimizer.reduce_gradients:
        raise CommError("commlib.elastic.State: a ZeroRedundancyOptimizer with "
                        "reduce_gradients=True is not supported (not tested under failures: "
                        "use it with reduce_gradients=False behind state.wrap(), whose "
                        "gradient_allreduce averages the gradients)")
