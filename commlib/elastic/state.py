"""``commlib.elastic.State``: what training needs to go on after a failure, committed in
memory, restored on the survivors, sent to the ranks that lack it."""
from __future__ import annotations

import copy
from typing import Any

import torch

from ..base.errors import CommError
from ..ddp.replicas import per_rank_state  # noqa: F401
from ..primitives import broadcast, world  # noqa: F401
from . import refill, transfer  # noqa: F401
from . import zero as zero_elastic

# The state's parts, one concept a module; their names are importable from here too.
from .commit_buffers import copy_tree  # noqa: F401
from .commits import _commit_after_average, _Commits, _Snapshot
from .handoff import TRANSFER_TAG, _Handoff  # noqa: F401
from .policies import (  # noqa: F401
    PER_RANK,
    POLICIES,
    REPLICATED,
    SHARDED_REASON,
    SYNCED,
    UNSUPPORTED,
    _refuse_sharded,
)
from .recovery import _Recovery


class State(_Commits, _Recovery, _Handoff):
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
        d["spare_target"] = 0       # the pool's size to refill to (run(refill=True))
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
    def commit(self) -> None:
        """Count one completed training step and, every ``commit_every`` steps, commit the
        state in memory (rank-local; see the class docstring). Call it after each
        ``optimizer.step()``."""
        d = self.__dict__
        d["step"] += 1
        if self.policy == SYNCED:
            d["_pending_values"] = (self.step, copy.deepcopy(self.values))
            if refill.due(self):
                raise refill.RefillDue()
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
        if refill.due(self):  # (every trainer at the same step: run() refills the pool)
            raise refill.RefillDue()

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

    def drop_gradients(self) -> None:
        """Forget every gradient (they may view the failed wrapper's buffers, which MPI may
        still write)."""
        if self.model is not None:
            for p in self.model.parameters():
                p.grad = None
