"""HET's bounded-staleness embedding cache (``ShardedEmbeddingBag(..., cache=...)``).

Every row carries a version at its owner: the number of updates applied to it there. A
rank keeps up to ``capacity_rows`` rows it used, each with the owner version it reflects
and the gradient it accumulated since its last push.

* **Reads** send ``(id, cached version)`` to the owners, which answer with their version
  and, only where the cached copy is missing or more than ``pull_bound`` versions behind,
  the row (refreshed copies keep this rank's unpushed local updates). Every read therefore
  satisfies ``owner_version - used_version <= pull_bound``.
* **Writes** stay local (the copy is updated at once with the SGD rule, when the table's
  optimizer is SGD) until a row has more than ``push_bound`` unpushed updates or is evicted
  (dirty rows only are written back); ``flush()`` pushes everything.
* **Eviction** at each step brings the cache back to ``capacity_rows``: least recently used
  rows first (``"lru"``) or least frequently used (``"lfu"``, ties least recent, then id).

With both bounds 0 the result equals the uncached synchronous table.
"""
from __future__ import annotations

from typing import Any

import torch

from ..primitives import alltoall_v
from . import exchange

POLICIES = ("lru", "lfu")


def eviction_order(entries: dict[int, tuple[int, int]], policy: str) -> list[int]:
    """Ids in the order they are evicted. ``entries``: id -> (last use tick, use count).
    Pure; ``"lru"``: oldest last use first (ties: smaller id); ``"lfu"``: fewest uses
    first (ties: oldest last use, then smaller id)."""
    if policy == "lru":
        return sorted(entries, key=lambda i: (entries[i][0], i))
    return sorted(entries, key=lambda i: (entries[i][1], entries[i][0], i))


class EmbeddingCache:
    """A per-rank cache of rows of one sharded table (see the module docstring).

    ``capacity_rows``: rows kept between steps (a batch may bring more in; the excess is
    evicted at its step). ``pull_bound``/``push_bound``: ints >= 0. Attach by passing it
    as ``cache=`` to one :class:`ShardedEmbeddingBag`; every method of an attached cache
    that communicates is collective over the table's group.
    """

    def __init__(self, capacity_rows: int, policy: str = "lru", pull_bound: int = 0,
                 push_bound: int = 0) -> None:
        for name, value, low in (("capacity_rows", capacity_rows, 1),
                                 ("pull_bound", pull_bound, 0), ("push_bound", push_bound, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"EmbeddingCache: argument {name!r} must be an int >= {low}, "
                                 f"got {value!r}")
        if policy not in POLICIES:
            raise ValueError(f"EmbeddingCache: argument 'policy' must be one of {POLICIES}, "
                             f"got {policy!r}")
        self.capacity, self.policy = capacity_rows, policy
        self.pull_bound, self.push_bound = pull_bound, push_bound
        self.table: Any = None
        self.value: dict[int, torch.Tensor] = {}     # the cached copy
        self.version: dict[int, int] = {}            # owner version the copy reflects
        self.grad: dict[int, torch.Tensor] = {}      # unpushed gradient (dirty rows)
        self.count: dict[int, int] = {}              # unpushed updates
        self.use: dict[int, tuple[int, int]] = {}    # (last use tick, use count)
        self.tick = 0
        # Logs for tests: one (ids, owner_version, used_version) per read; pushed grads.
        self.read_log: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self.push_log: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.skip_evicted_push = False  # negative control for tests

    def attach(self, table: Any) -> None:
        if self.table is not None:
            raise ValueError("EmbeddingCache: this cache already serves a table")
        self.table = table
        table.policy = self

    def __len__(self) -> int:
        return len(self.value)

    # -- reads -------------------------------------------------------------------------
    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the sorted unique ``ids``, ``(len(ids), dim)`` (any lookup, training or
        not, of the open batch); collective."""
        t = self.table
        keys = ids.tolist()
        have = torch.tensor([self.version.get(i, -1) for i in keys], dtype=torch.int64)
        perm, splits = exchange.route(ids, t.n)
        recv = exchange.exchange_counts(splits, t.group)
        asked = alltoall_v(torch.stack([ids[perm], have[perm]], 1), splits, recv,
                           group=t.group)
        local = torch.div(asked[:, 0], t.n, rounding_mode="floor")
        owner_version = t.version[local]
        need = (asked[:, 1] < 0) | (owner_version - asked[:, 1] > self.pull_bound)
        answer = alltoall_v(torch.stack([owner_version, need.long()], 1), recv, splits,
                            group=t.group)
        row_send = [int(c) for c in _segment_sums(need, recv)]
        row_recv = [int(c) for c in _segment_sums(answer[:, 1].bool(), splits)]
        rows = alltoall_v(t.weight[local[need]], row_send, row_recv, group=t.group)
        # back to the order of ids
        versions = torch.empty_like(answer[:, 0])
        versions[perm] = answer[:, 0]
        needed = torch.empty(len(keys), dtype=torch.bool)
        needed[perm] = answer[:, 1].bool()
        fresh = iter(rows)
        for pos in perm[needed[perm]].tolist():  # rows arrive in owner order
            i = keys[pos]
            row = next(fresh).clone()
            if i in self.grad and t.optimizer.name == "sgd":
                row.add_(self.grad[i], alpha=-t.optimizer.lr / t.n)  # keep local writes
            self.value[i] = row
            self.version[i] = int(versions[pos])
        used = torch.tensor([self.version[i] for i in keys], dtype=torch.int64)
        if self.read_log is not None:
            self.read_log.append((ids.clone(), versions.clone(), used))
        self.tick += 1
        for i in keys:
            last, uses = self.use.get(i, (0, 0))
            self.use[i] = (self.tick, uses + 1)
        if not keys:
            return torch.zeros(0, t.dim, dtype=t.dtype)
        return torch.stack([self.value[i] for i in keys])

    # -- writes ------------------------------------------------------------------------
    def step(self) -> None:
        """Take this batch's gradients into the cache (local write-back), push rows over
        the push bound and the dirty rows evicted down to capacity. Collective."""
        t = self.table
        if t.backward_seen:
            t.closed += 1
            t.backward_seen = False
            ids, grads = t.take_pending()
            sgd = t.optimizer.name == "sgd"
            for i, g in zip(ids.tolist(), grads):
                if i in self.grad:
                    self.grad[i] = self.grad[i] + g
                else:
                    self.grad[i] = g.clone()
                self.count[i] = self.count.get(i, 0) + 1
                if sgd and i in self.value:
                    self.value[i] = self.value[i] - (t.optimizer.lr / t.n) * g
        push = [i for i, c in self.count.items() if c > self.push_bound]
        excess = len(self.value) - self.capacity
        evicted = eviction_order(self.use, self.policy)[:max(0, excess)]
        for i in evicted:
            if i in self.grad and not self.skip_evicted_push:
                push.append(i)
            elif i in self.grad:  # the negative control forgets them
                del self.grad[i], self.count[i]
            for d in (self.value, self.version, self.use):
                d.pop(i, None)
        self._push(sorted(set(push)))
        t.applied = t.closed

    def flush(self) -> None:
        """Close the open batch and push every dirty row (the table then holds every
        update). Collective."""
        self.step()
        self._push(sorted(self.grad))

    def invalidate(self) -> None:
        """Forget every cached row (after the table was loaded). Local; unpushed updates
        are dropped."""
        for d in (self.value, self.version, self.grad, self.count, self.use):
            d.clear()

    def _push(self, keys: list[int]) -> None:
        t = self.table
        ids = torch.tensor(keys, dtype=torch.int64)
        if keys:
            grads = torch.stack([self.grad.pop(i) for i in keys])
        else:
            grads = torch.zeros(0, t.dim, dtype=t.dtype)
        for i in keys:
            del self.count[i]
        if self.push_log is not None:
            self.push_log.append((ids, grads))
        t.push(ids, grads, t.closed)


def _segment_sums(flags: torch.Tensor, splits: list[int]) -> list[int]:
    out, start = [], 0
    for s in splits:
        out.append(int(flags[start:start + s].sum()))
        start += s
    return out
