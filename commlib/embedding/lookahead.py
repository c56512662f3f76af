"""Bagpipe's lookahead: with a deterministic data order, fetch the rows of the next
``lookahead`` batches early and split each step's gradient exchange into what the next
fetch needs (now) and the rest (in the background), with results equal to synchronous
training.

Every batch's ids enter a window ``lookahead + 1`` batches before they are trained; the
union over ranks of each batch's ids (``touched[b]``: the rows batch ``b`` updates at its
end) is known on every rank alike (one ``allgather_v`` per batch). A row this rank uses in
batch ``b`` may be fetched at the start of step ``f`` (``b - lookahead <= f <= b``) only
if no batch in ``[f, b - 1]`` touches it, so the fetched value is the synchronous one. The
oracle fetches each row at the earliest such step, keeps it until its use and evicts it
right after; within ``capacity`` rows held (optional), earlier uses first. A row is never
kept across two uses: every use updates it, and the next use needs the updated value.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from ..errors import where
from ..primitives import allgather_v


def decide(step: int, mine: dict[int, set[int]], touched: dict[int, set[int]],
           fetched: set[tuple[int, int]], held: int, lookahead: int,
           capacity: int | None) -> dict[int, list[int]]:
    """The oracle's decisions for one step (pure).

    ``mine[b]``/``touched[b]``: this rank's ids and all ranks' ids of the batches
    ``step .. step + lookahead`` (missing batches: none); ``fetched``: ``(batch, id)``
    pairs already fetched; ``held``: rows held before this step's fetch (those of batch
    ``step`` included). Returns ``{batch: sorted ids}`` to fetch now: every unfetched id
    of batch ``step``, then, while fewer than ``capacity`` rows would be held, the
    unfetched ids of later batches that no batch in ``[step, batch - 1]`` touches
    (earliest batch first, then smallest id), each only if the rows held stay within
    ``capacity`` at every step until its use (so later batches' own rows always fit).
    """
    out: dict[int, list[int]] = {}
    due = sorted(i for i in mine.get(step, ()) if (step, i) not in fetched)
    if due:
        out[step] = due
    held += len(due)
    last = step + lookahead
    if capacity is not None:
        for b in range(step, last + 1):
            if len(mine.get(b, ())) > capacity:
                raise ValueError(f"LookaheadLoader: argument 'capacity'={capacity} is below "
                                 f"the {len(mine[b])} rows batch {b} alone needs")
        # load[c]: rows held at step c (c > step) if nothing else were prefetched: the
        # rows already fetched for batches >= c, plus batch c's rows still to fetch
        load = {c: sum(1 for (b, _) in fetched if c <= b <= last)
                + sum(1 for i in mine.get(c, ()) if (c, i) not in fetched)
                for c in range(step + 1, last + 1)}
    between: set[int] = set()
    for b in range(step + 1, last + 1):
        between |= touched.get(b - 1, set())
        for i in sorted(mine.get(b, ())):
            if (b, i) in fetched or i in between:
                continue
            if capacity is not None:
                # held now, and at every later step until b (at b it replaces a fetch)
                if held >= capacity or any(load[c] >= capacity for c in range(step + 1, b)):
                    continue
                for c in range(step + 1, b):
                    load[c] += 1
            out.setdefault(b, []).append(i)
            held += 1
    return out


def plan(mine: Sequence[set[int]], touched: Sequence[set[int]], lookahead: int,
         capacity: int | None = None) -> list[dict[int, list[int]]]:
    """:func:`decide` over whole sequences (pure): per step, ``{batch: ids}`` fetched.
    Rows are evicted right after the batch that uses them."""
    steps = len(mine)
    fetched: set[tuple[int, int]] = set()
    out = []
    for s in range(steps):
        window = range(s, min(steps, s + lookahead + 1))
        held = sum(1 for (b, _) in fetched if b >= s)
        d = decide(s, {b: mine[b] for b in window}, {b: touched[b] for b in window},
                   fetched, held, lookahead, capacity)
        for b, ids in d.items():
            fetched.update((b, i) for i in ids)
        out.append(d)
    return out


class _Schedule:
    """One table's lookahead state; its ``step``/``flush`` replace the table's."""

    def __init__(self, module: Any, lookahead: int, capacity: int | None) -> None:
        self.module, self.table = module, module.table
        self.lookahead, self.capacity = lookahead, capacity
        self.mine: dict[int, set[int]] = {}
        self.touched: dict[int, set[int]] = {}
        self.fetched: set[tuple[int, int]] = set()
        self.chunks: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.later: Callable[[], None] | None = None
        self.held_log: list[int] = []
        self.batch = -1  # the batch being trained
        self.table.policy = self

    def enter(self, b: int, ids: torch.Tensor | None) -> None:
        """Batch ``b`` enters the window (``None``: past the end). Collective."""
        mine = torch.unique(ids) if ids is not None else torch.zeros(0, dtype=torch.int64)
        self.mine[b] = set(mine.tolist())
        parts = allgather_v(mine, group=self.table.group)
        self.touched[b] = set(torch.cat(parts).tolist()) if parts else set()

    def fetch_round(self, s: int) -> None:
        """The fetches the oracle decides at the start of step ``s``. Collective."""
        t = self.table
        held = sum(len(ids) for b, ch in self.chunks.items() if b >= s for ids, _ in ch)
        window = range(s, s + self.lookahead + 1)
        d = decide(s, {b: self.mine.get(b, set()) for b in window},
                   {b: self.touched.get(b, set()) for b in window}, self.fetched, held,
                   self.lookahead, self.capacity)
        pairs = [(b, i) for b, ids in d.items() for i in ids]
        self.fetched.update(pairs)
        ids = torch.tensor(sorted({i for _, i in pairs}), dtype=torch.int64)
        rows = t.fetch(ids)
        for b, want in d.items():
            w = torch.tensor(want, dtype=torch.int64)
            self.chunks.setdefault(b, []).append((w, rows[torch.searchsorted(ids, w)]))
        self.held_log.append(held + len(pairs))

    def rows_of(self, s: int, uniq: torch.Tensor) -> torch.Tensor:
        """The rows of batch ``s``'s sorted unique ids (evicted from the window)."""
        chunks = self.chunks.pop(s, [])
        if not chunks:
            return torch.zeros(0, self.table.dim, dtype=self.table.dtype)
        ids = torch.cat([c[0] for c in chunks])
        rows = torch.cat([c[1] for c in chunks])
        order = torch.argsort(ids)
        ids, rows = ids[order], rows[order]
        self.fetched = {(b, i) for (b, i) in self.fetched if b > s}
        return rows[torch.searchsorted(ids, uniq)]

    def step(self) -> None:
        """End of the trained batch: gradients of rows some rank fetches at the next step
        go to the owners now; the rest in the background, applied at the next step."""
        t = self.table
        if t.trained <= t.closed:
            return
        t.closed += 1
        t.backward_seen = False
        b = self.batch
        ids, grads = t.take_pending()
        soon: set[int] = set()
        for c in range(b + 1, b + self.lookahead + 2):
            soon |= self.touched.get(c, set())
        now = torch.tensor([i in soon for i in ids.tolist()], dtype=torch.bool)
        if self.later is not None:  # the previous step's background part, first
            self.later()
            self.later = None
        t.push(ids[now], grads[now], t.closed)
        self.later = t.start_push(ids[~now], grads[~now], t.closed)
        t.applied = t.closed

    def flush(self) -> None:
        self.step()
        if self.later is not None:
            self.later()
            self.later = None

    def close(self) -> None:
        """Apply what is outstanding and hand batches back to the table. Collective."""
        self.flush()
        self.table.policy = self.table


class LookaheadLoader:
    """Iterate a deterministic ``loader`` with Bagpipe's lookahead over sharded tables.

    ``tables``: :class:`ShardedEmbeddingBag`/:class:`ShardedEmbedding` modules (no cache,
    no staleness); ``inputs(batch)``: one id tensor per table (the ``input`` that batch
    passes to it); ``lookahead``: L >= 0 batches fetched ahead; ``capacity``: most rows
    held per table and rank (``None``: unbounded). Every rank's loader must yield the same
    number of batches, and each training batch calls each table once, in order; the
    results equal synchronous training. Collective over the tables' groups.
    """

    def __init__(self, loader: Iterable, tables: Sequence[Any],
                 inputs: Callable[[Any], Sequence[torch.Tensor]], lookahead: int = 2,
                 capacity: int | None = None) -> None:
        if not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"LookaheadLoader: argument 'lookahead' must be an int >= 0, "
                             f"got {lookahead!r}")
        for table in tables:
            if table.cache is not None or table.table.staleness:
                raise ValueError(f"{where('LookaheadLoader', table.table.rank)}: argument "
                                 f"'tables' must hold tables without cache or staleness")
        self.loader, self.inputs, self.lookahead = loader, inputs, lookahead
        self.schedules = [_Schedule(t, lookahead, capacity) for t in tables]

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        window: deque = deque()
        entered = 0
        exhausted = False
        s = 0
        while True:
            # the window holds batches s .. s + L + 1 (their ids known on every rank)
            while entered <= s + self.lookahead + 1:
                batch = None
                if not exhausted:
                    try:
                        batch = next(it)
                    except StopIteration:
                        exhausted = True
                ids = self.inputs(batch) if batch is not None else [None] * len(self.schedules)
                for sched, x in zip(self.schedules, ids):
                    sched.enter(entered, None if x is None else x.reshape(-1).long())
                if batch is not None:
                    window.append(batch)
                entered += 1
            if not window:
                for sched in self.schedules:
                    sched.close()
                return
            batch = window.popleft()
            ids = self.inputs(batch)
            for sched, x in zip(self.schedules, ids):
                sched.fetch_round(s)
                sched.batch = s
                flat = x.reshape(-1).long()
                sched.module._prefetch_ready(flat, sched.rows_of(s, torch.unique(flat)))
            yield batch
            s += 1
