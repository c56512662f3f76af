"""The sharded table behind :class:`ShardedEmbeddingBag`: this rank's rows, their
optimizer state and versions, and the collective lookups and updates.

Row ``i`` lives on group rank ``i % n`` at local row ``i // n``. A *batch* is everything
between two :meth:`ShardTable.step` calls that close one (an optimizer step after at least
one backward pass through the table): every lookup of the open batch reads the same
table, and the gradients of all its lookups and backward passes are summed into one
update, as torch accumulates ``.grad`` until ``optimizer.step()``. Batch ``j`` (0-based;
the open one is ``closed``) may be read early (prefetched). With ``staleness=tau`` the
update of a batch may wait in a queue; the table keeps the invariant

    a read for batch ``j`` sees the updates of at least ``j - tau`` batches
    (``applied >= j - tau``; a lookup of the open batch: ``applied >= closed - tau``),

applying the oldest queued updates before a read whenever it would break. ``tau = 0`` is
synchronous: every update is applied at the step that closes its batch.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ..base.errors import where
from ..primitives import allgather_v, alltoall_v, new_group
from . import exchange
from .optim import make_optimizer


class ShardTable:
    """State and collectives of one sharded table (every method is collective over the
    group unless it says otherwise)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Any, optimizer: Any,
                 lr: float, dtype: torch.dtype, staleness: int, owner: str,
                 weight: torch.Tensor | None, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0) -> None:
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
            if padding_idx is not None and padding_idx % self.n == self.rank:
                self.weight[padding_idx // self.n] = 0  # torch: the padding row starts at 0
        self.padding_idx = padding_idx
        self.max_norm, self.norm_type = max_norm, norm_type
        self.version = torch.zeros(rows, dtype=torch.int64)
        self.optimizer = make_optimizer(optimizer, lr, self.rank)
        self.optimizer.init_state(self.weight)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # this batch's grads
        self.queue: deque = deque()        # closed batches whose update is not applied
        self.closed = 0                    # batches closed by step() (the open one's index)
        self.applied = 0                   # batches whose update is applied
        self.backward_seen = False         # the open batch holds gradients
        # What closes batches and flushes: the table itself, or an attached cache or
        # lookahead schedule (objects with step() and flush()).
        self.policy: Any = self
        # Test hooks: a list receiving one record per read, and a filter on what an owner
        # applies (a negative control drops the rows other ranks sent).
        self.read_log: list[dict] | None = None
        self.apply_filter: Callable | None = None

    # -- reads -------------------------------------------------------------------------
    def check_ids(self, ids: torch.Tensor, name: str = "input") -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise ValueError(f"{where(self.owner, self.rank)}: argument {name!r} holds ids "
                             f"outside [0, {self.num_embeddings}): min {int(ids.min())}, "
                             f"max {int(ids.max())}")

    def begin_read(self, ahead: int = 0) -> int:
        """A read for batch ``closed + ahead`` (``ahead`` batches after the open one) is
        about to happen: apply queued updates first where the staleness bound requires it
        (collective when it applies). Returns the batch's index."""
        batch = self.closed + ahead
        while self.applied < batch - self.staleness:
            if not self.queue:
                raise RuntimeError(
                    f"{where(self.owner, self.rank)}: cannot read batch {batch} with "
                    f"staleness {self.staleness}: only {self.closed} batches closed by a "
                    f"step, {self.applied} applied")
            self.apply_oldest()
        return batch

    def before_read(self, ids: torch.Tensor, grad: bool) -> None:
        """Policy hook: a lookup no schedule prepared is about to read ``ids`` of the open
        batch (``grad``: its rows are in the autograd graph). Nothing to do here; a
        lookahead schedule applies what is outstanding. Collective."""

    def fetch(self, ids: torch.Tensor, async_op: bool = False, batch: int | None = None,
              ahead: bool = False) -> Any:
        """Rows of the sorted unique ``ids`` from their owners, shape ``(len(ids), dim)``
        (new tensor), or a callable returning it when ``async_op``. With ``max_norm`` the
        owners first renormalise the asked rows in place (``torch.embedding_renorm_``, as
        ``nn.Embedding``'s forward does); ``ahead``: only the rows served (the read is
        early: the table is renormalised when the batch is trained, :meth:`renorm`).
        ``batch``: the batch the read is for (logs)."""
        req = exchange.Request(ids, self.group, self.n)
        local = torch.div(req.asked, self.n, rounding_mode="floor")
        if self.max_norm is not None and len(local) and not ahead:
            torch.embedding_renorm_(self.weight, torch.unique(local), self.max_norm,
                                    self.norm_type)
        rows = self.weight[local]
        if self.max_norm is not None and len(local) and ahead:
            torch.embedding_renorm_(rows, torch.arange(len(rows)), self.max_norm,
                                    self.norm_type)
        if self.read_log is not None:
            self.read_log.append({"batch": self.closed if batch is None else batch,
                                  "applied": self.applied, "ids": req.asked.clone(),
                                  "version": self.version[local].clone()})
        work = exchange.reply(req, rows, self.group, async_op=async_op)
        if not async_op:
            return exchange.unroute(req, work)
        return lambda: exchange.unroute(req, work.wait())

    def renorm(self, ids: Any) -> None:
        """Local, with ``max_norm``: renormalise this rank's rows among the global ``ids``
        in place (what the forward of a batch whose rows were read ahead does)."""
        if self.max_norm is None:
            return
        local = [i // self.n for i in ids if i % self.n == self.rank]
        if local:
            torch.embedding_renorm_(self.weight, torch.tensor(sorted(local)), self.max_norm,
                                    self.norm_type)

    # -- updates -----------------------------------------------------------------------
    def accumulate(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Local, from autograd: the gradient of the rows of ``ids`` (unique) in this
        rank's open batch."""
        self.pending.append((ids, grad.detach().to(self.dtype)))
        self.backward_seen = True

    def step(self) -> None:
        """Close the open batch if a backward pass reached the table in it (every rank
        alike, as DDP requires): its gradients join the queue; applied at once when
        ``staleness == 0``. A batch without gradients stays open (torch's optimizers skip
        a parameter whose ``.grad`` is None)."""
        if self.backward_seen:
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
        self.closed = self.applied = step
