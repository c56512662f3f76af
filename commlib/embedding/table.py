"""The sharded table behind :class:`ShardedEmbeddingBag`: this rank's rows, their
optimizer state and versions, and the collective lookups and updates.

Row ``i`` lives on group rank ``i % n`` at local row ``i // n``. A *batch* is what the
training lookups between two :meth:`ShardTable.step` calls read. With ``staleness=tau``
the update of a batch may wait in a queue; the table keeps the invariant

    at the moment a batch is read, at most ``tau`` earlier batches were read whose
    updates are not yet applied (``issued - applied <= tau``),

applying the oldest queued updates before a read whenever it would break. ``tau = 0`` is
synchronous: every update is applied at the step that closes its batch.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable

import torch

from ..errors import where
from ..primitives import allgather_v, alltoall_v, new_group
from . import exchange
from .optim import make_optimizer


class ShardTable:
    """State and collectives of one sharded table (every method is collective over the
    group unless it says otherwise)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Any, optimizer: Any,
                 lr: float, dtype: torch.dtype, staleness: int, owner: str,
                 weight: torch.Tensor | None) -> None:
        from ..primitives._base import resolve
        parent = resolve(group, owner)
        self.owner = owner
        self.rank, self.n = parent.rank, parent.size
        for name, value in (("num_embeddings", num_embeddings),
                            ("embedding_dim", embedding_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{where(owner, self.rank)}: argument {name!r} must be a "
                                 f"positive int, got {value!r}")
        if not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"{where(owner, self.rank)}: argument 'staleness' must be an "
                             f"int >= 0, got {staleness!r}")
        # A communicator of our own: these collectives never match the user's or DDP's.
        self.group = new_group(parent=group)
        self.num_embeddings, self.dim = num_embeddings, embedding_dim
        self.dtype = dtype
        self.staleness = staleness
        rows = len(range(self.rank, num_embeddings, self.n))
        if weight is not None:
            if tuple(weight.shape) != (num_embeddings, embedding_dim):
                raise ValueError(f"{where(owner, self.rank)}: argument '_weight' must have "
                                 f"shape {(num_embeddings, embedding_dim)}, got "
                                 f"{tuple(weight.shape)}")
            self.weight = weight.detach()[self.rank::self.n].to(dtype).clone()
        else:
            self.weight = torch.randn(rows, embedding_dim, dtype=dtype)
        self.version = torch.zeros(rows, dtype=torch.int64)
        self.optimizer = make_optimizer(optimizer, lr, self.rank)
        self.optimizer.init_state(self.weight)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # this batch's grads
        self.queue: deque = deque()        # closed batches whose update is not applied
        self.issued = 0                    # batches read (training lookups)
        self.trained = 0                   # batches whose training forward ran
        self.closed = 0                    # batches closed by step()
        self.applied = 0                   # batches whose update is applied
        self.backward_seen = False
        # What closes batches and flushes: the table itself, or an attached cache or
        # lookahead schedule (objects with step() and flush()).
        self.policy: Any = self
        # Test hooks: a list receiving one record per read, and a filter on what an owner
        # applies (a negative control drops the rows other ranks sent).
        self.read_log: list[dict] | None = None
        self.apply_filter: Callable | None = None

    # -- reads -------------------------------------------------------------------------
    def begin_training(self) -> None:
        """Local: a training forward runs; the first one after a step opens a batch."""
        if self.trained > self.closed and self.backward_seen:
            self.policy.step()  # a new forward after a backward: the last batch is over
        if self.trained == self.closed:
            self.trained += 1

    def check_ids(self, ids: torch.Tensor, name: str = "input") -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise ValueError(f"{where(self.owner, self.rank)}: argument {name!r} holds ids "
                             f"outside [0, {self.num_embeddings}): min {int(ids.min())}, "
                             f"max {int(ids.max())}")

    def begin_read(self) -> int:
        """Account for a new training batch read; apply queued updates first where the
        staleness bound requires it. Returns the batch's index."""
        if self.trained > self.closed and self.backward_seen:
            self.policy.step()  # at the latest before the next lookup
        while self.issued - self.applied > self.staleness:
            if not self.queue:
                raise RuntimeError(
                    f"{where(self.owner, self.rank)}: cannot read batch {self.issued} with "
                    f"staleness {self.staleness}: only {self.closed} batches closed by a "
                    f"step, {self.applied} applied")
            self.apply_oldest()
        index = self.issued
        self.issued += 1
        return index

    def fetch(self, ids: torch.Tensor, async_op: bool = False) -> Any:
        """Rows of the sorted unique ``ids`` from their owners, shape ``(len(ids), dim)``
        (new tensor), or a callable returning it when ``async_op``."""
        req = exchange.Request(ids, self.group, self.n)
        local = torch.div(req.asked, self.n, rounding_mode="floor")
        rows = self.weight[local]
        if self.read_log is not None:
            self.read_log.append({"batch": self.issued - 1, "applied": self.applied,
                                  "ids": req.asked.clone(), "version":
                                  self.version[local].clone()})
        work = exchange.reply(req, rows, self.group, async_op=async_op)
        if not async_op:
            return exchange.unroute(req, work)
        return lambda: exchange.unroute(req, work.wait())

    # -- updates -----------------------------------------------------------------------
    def accumulate(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Local, from autograd: the gradient of the rows of ``ids`` (unique) in this
        rank's open batch."""
        self.pending.append((ids, grad.detach().to(self.dtype)))
        self.backward_seen = True

    def step(self) -> None:
        """Close the open batch (if any): its gradients join the queue; applied at once
        when ``staleness == 0``."""
        if self.trained > self.closed:
            self.queue.append(self.take_pending())
            self.closed += 1
            self.backward_seen = False
        if self.staleness == 0:
            while self.queue:
                self.apply_oldest()

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pending:
            ids = torch.cat([i for i, _ in self.pending])
            grads = torch.cat([g for _, g in self.pending])
        else:
            ids = torch.zeros(0, dtype=torch.int64)
            grads = torch.zeros(0, self.dim, dtype=self.dtype)
        self.pending = []
        return ids, grads

    def flush(self) -> None:
        """Close the open batch and apply every queued update."""
        self.step()
        while self.queue:
            self.apply_oldest()

    def apply_oldest(self) -> None:
        ids, grads = self.queue.popleft()
        self.push(ids, grads, self.applied + 1)
        self.applied += 1

    def push(self, ids: torch.Tensor, grads: torch.Tensor, step: int) -> None:
        """Send row gradients to their owners; each owner sums them per row, divides by
        the group size (the average over ranks) and applies its optimizer as the update of
        batch ``step`` (1-based; Adam's bias correction); versions of the updated rows grow
        by one."""
        perm, splits = exchange.route(ids, self.n)
        recv = exchange.exchange_counts(splits, self.group)
        got_ids = alltoall_v(ids[perm], splits, recv, group=self.group)
        got = alltoall_v(grads[perm], splits, recv, group=self.group)
        if self.apply_filter is not None:
            got_ids, got = self.apply_filter(self, got_ids, got, recv)
        self.apply_rows(torch.div(got_ids, self.n, rounding_mode="floor"), got, step)

    def start_push(self, ids: torch.Tensor, grads: torch.Tensor,
                   step: int) -> Callable[[], None]:
        """:meth:`push` with the gradient exchange in the background: returns a callable
        that waits for it and applies (call it on every rank, in the same order)."""
        perm, splits = exchange.route(ids, self.n)
        recv = exchange.exchange_counts(splits, self.group)
        ids_work = alltoall_v(ids[perm], splits, recv, group=self.group, async_op=True)
        grad_work = alltoall_v(grads[perm], splits, recv, group=self.group, async_op=True)

        def finish() -> None:
            got_ids, got = ids_work.wait(), grad_work.wait()
            if self.apply_filter is not None:
                got_ids, got = self.apply_filter(self, got_ids, got, recv)
            self.apply_rows(torch.div(got_ids, self.n, rounding_mode="floor"), got, step)
        return finish

    def apply_rows(self, local: torch.Tensor, grads: torch.Tensor, step: int) -> None:
        """Local: sum ``grads`` per local row, average over the group, apply."""
        rows, inverse = torch.unique(local, sorted=True, return_inverse=True)
        total = torch.zeros(len(rows), self.dim, dtype=self.dtype)
        total.index_add_(0, inverse, grads)
        if self.n > 1:
            total.div_(self.n)
        self.optimizer.apply(self.weight, rows, total, step)
        self.version[rows] += 1

    # -- whole table -------------------------------------------------------------------
    def full(self, shard: torch.Tensor | None = None) -> torch.Tensor:
        """The whole table (or the whole of a per-row ``shard`` of the same layout, e.g.
        optimizer state) on every rank (allgather_v of the shards)."""
        shard = self.weight if shard is None else shard
        shards = allgather_v(shard, group=self.group)
        out = torch.empty(self.num_embeddings, self.dim, dtype=shard.dtype)
        for r, part in enumerate(shards):
            out[r::self.n] = part
        return out

    def load(self, full: torch.Tensor, shard: torch.Tensor | None = None) -> None:
        """Local: keep this rank's rows of a whole table (into ``shard``: the weight
        unless given)."""
        shard = self.weight if shard is None else shard
        shard.copy_(full.detach()[self.rank::self.n].to(shard.dtype))

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's name, hyperparameters, the batches applied so far (Adam's
        step) and each per-row state tensor gathered whole. Flush first. Collective."""
        opt = self.optimizer
        hyper = {k: v for k, v in vars(opt).items() if isinstance(v, (int, float))}
        return {"optimizer": opt.name, "hyperparameters": hyper, "step": self.applied,
                "state": {k: self.full(v) for k, v in sorted(opt.state_tensors().items())}}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Local: keep this rank's rows of each state tensor; batch counters continue
        from the saved step. Raises ``ValueError`` naming what does not fit."""
        opt, here = self.optimizer, where(self.owner, self.rank)
        if not isinstance(state, dict) or state.get("optimizer") != opt.name:
            got = state.get("optimizer") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"{here}: the optimizer state is for {got!r}, this table's "
                             f"optimizer is {opt.name!r}")
        mine = opt.state_tensors()
        saved = state.get("state", {})
        if set(saved) != set(mine):
            raise ValueError(f"{here}: optimizer state holds {sorted(saved)}, expected "
                             f"{sorted(mine)}")
        want = (self.num_embeddings, self.dim)
        for key, full in saved.items():
            if tuple(full.shape) != want:
                raise ValueError(f"{here}: optimizer state {key!r} has shape "
                                 f"{tuple(full.shape)}, expected {want}")
        for key, full in saved.items():
            self.load(full, mine[key])
        step = int(state.get("step", 0))
        self.issued = self.trained = self.closed = self.applied = step
