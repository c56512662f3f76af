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

Lookups the schedule did not prepare (evaluation between steps, a lookup more than
``inputs`` lists, any lookup after leaving the loop) first apply the background part of
the last update, so they read the synchronous rows; when their rows are in the autograd
graph, every rank learns them and rows held for later batches among them are fetched
again after the update. A batch without an optimizer step (accumulation over loader
batches) keeps its rows out of early fetches until the step. With ``max_norm`` rows
fetched ahead are served renormalised and the owners renormalise the table when the
batch trains (as torch's forward). Ending a pass (exhausted, ``break``, ``close()``) only
completes requests already issued on every rank: nothing collective is left for it.
"""
from __future__ import annotations

import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ..base.errors import where
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
    """One table's lookahead state during one pass of a :class:`LookaheadLoader`; its
    ``step``/``flush``/``before_read`` replace the table's while the pass runs."""

    def __init__(self, module: Any, lookahead: int, capacity: int | None) -> None:
        self.module, self.table = module, module.table
        self.lookahead, self.capacity = lookahead, capacity
        self.mine: dict[int, set[int]] = {}
        self.touched: dict[int, set[int]] = {}
        self.fetched: set[tuple[int, int]] = set()
        self.chunks: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.later: Callable[[], None] | None = None
        self.later_batch = -1  # the batch whose step left ``later``
        self.held_log: list[int] = []
        self.batch = -1  # the batch being trained
        previous = self.table.policy
        if previous is not self.table:  # a pass over this table never closed
            previous.close()
        self.table.policy = self

    def enter(self, b: int, ids: torch.Tensor | None) -> None:
        """Batch ``b`` enters the window (``None``: past the end). Collective. Batch 0
        also counts the gradients the open batch holds from before the pass (they are
        applied at batch 0's step)."""
        mine = torch.unique(ids) if ids is not None else torch.zeros(0, dtype=torch.int64)
        self.mine[b] = set(mine.tolist())
        local = mine
        if b == 0 and self.table.pending:
            local = torch.unique(torch.cat([mine] + [i for i, _ in self.table.pending]))
        parts = allgather_v(local, group=self.table.group)
        self.touched[b] = set(torch.cat(parts).tolist()) if parts else set()

    def fetch_round(self, s: int) -> None:
        """The fetches the oracle decides at the start of step ``s``. Collective."""
        t = self.table
        if self.later is not None and self.later_batch != s - 1:
            self._finish_later()  # no step since: the next fetches may need those rows
        if s > 0 and t.backward_seen:
            # batch s - 1 had no step: its update lands with batch s's (accumulation)
            self.touched[s] = self.touched.get(s, set()) | self.touched.get(s - 1, set())
        for old in [b for b in self.touched if b < s - 1]:
            self.touched.pop(old)
            self.mine.pop(old, None)
        held = sum(len(ids) for b, ch in self.chunks.items() if b >= s for ids, _ in ch)
        window = range(s, s + self.lookahead + 1)
        d = decide(s, {b: self.mine.get(b, set()) for b in window},
                   {b: self.touched.get(b, set()) for b in window}, self.fetched, held,
                   self.lookahead, self.capacity)
        pairs = [(b, i) for b, ids in d.items() for i in ids]
        self.fetched.update(pairs)
        ids = torch.tensor(sorted({i for _, i in pairs}), dtype=torch.int64)
        rows = t.fetch(ids, batch=t.closed, ahead=True)
        for b, want in d.items():
            w = torch.tensor(want, dtype=torch.int64)
            self.chunks.setdefault(b, []).append((w, rows[torch.searchsorted(ids, w)]))
        self.held_log.append(held + len(pairs))

    def serve(self, s: int, flats: Sequence[torch.Tensor]) -> list[Any]:
        """Prepared lookups of batch ``s``, one per input (its rows leave the window).
        With ``max_norm`` the owners renormalise the batch's rows now, when its forward
        runs, as torch does (the rows were served renormalised)."""
        self.table.renorm(self.touched.get(s, ()))
        chunks = self.chunks.pop(s, [])
        self.fetched = {(b, i) for (b, i) in self.fetched if b > s}
        if chunks:
            ids = torch.cat([c[0] for c in chunks])
            rows = torch.cat([c[1] for c in chunks])
            order = torch.argsort(ids)
            ids, rows = ids[order], rows[order]
        else:
            ids = torch.zeros(0, dtype=torch.int64)
            rows = torch.zeros(0, self.table.dim, dtype=self.table.dtype)
        return [self.module._ready(flat, rows[torch.searchsorted(ids, torch.unique(flat))])
                for flat in flats]

    def step(self) -> None:
        """End of the trained batch: gradients of rows some rank fetches at the next step
        go to the owners now; the rest in the background, applied at the next step (or
        before any read that needs them)."""
        t = self.table
        if not t.backward_seen:
            return
        t.closed += 1
        t.backward_seen = False
        b = self.batch
        ids, grads = t.take_pending()
        soon: set[int] = set()
        for c in range(b + 1, b + self.lookahead + 2):
            soon |= self.touched.get(c, set())
        now = torch.tensor([i in soon for i in ids.tolist()], dtype=torch.bool)
        self._finish_later()  # the previous step's background part, first
        t.push(ids[now], grads[now], t.closed)
        self.later = t.start_push(ids[~now], grads[~now], t.closed)
        self.later_batch = b
        t.applied = t.closed

    def _finish_later(self) -> None:
        """Wait for the background part and apply it (local: issued on every rank)."""
        if self.later is not None:
            later, self.later = self.later, None
            later()

    def before_read(self, ids: torch.Tensor, grad: bool) -> None:
        """A lookup the schedule did not prepare (evaluation, one more lookup of the
        batch): apply what is outstanding so it reads the synchronous rows; when its rows
        may get gradients (``grad``), the batch being trained also touches them: held
        rows of later batches among them are dropped (fetched again after the update)
        and later fetches wait for it. Collective."""
        self._finish_later()
        if not grad:
            return
        parts = allgather_v(ids, group=self.table.group)
        extra = set(torch.cat(parts).tolist()) if parts else set()
        if not extra:
            return
        b = max(self.batch, 0)
        self.touched[b] = self.touched.get(b, set()) | extra
        self.fetched = {(c, i) for (c, i) in self.fetched if c <= b or i not in extra}
        drop = torch.tensor(sorted(extra), dtype=torch.int64)
        for c in [c for c in self.chunks if c > b]:
            kept = []
            for w, r in self.chunks[c]:
                keep = ~torch.isin(w, drop)
                kept.append((w[keep], r[keep]))
            self.chunks[c] = kept

    def flush(self) -> None:
        self.step()
        self._finish_later()

    def invalidate(self) -> None:
        """Local: forget the rows held for later batches (the table was loaded); each is
        fetched again at its batch's step."""
        self.chunks = {}
        self.fetched = set()

    def close(self) -> None:
        """End of the pass (exhausted, abandoned or closed): apply the background part and
        hand the table back (local: no new collective, so it is safe whenever and
        wherever each rank's pass ends). An open batch stays open for the next step."""
        self._finish_later()
        if self.table.policy is self:
            self.table.policy = self.table


class LookaheadLoader:
    """Iterate a deterministic ``loader`` with Bagpipe's lookahead over sharded tables.

    ``tables``: :class:`ShardedEmbeddingBag`/:class:`ShardedEmbedding` modules (no cache,
    no staleness; one module may appear several times: one entry per lookup of a batch);
    ``inputs(batch)``: one id tensor per entry of ``tables`` (the ``input`` of that lookup
    in the batch's training forward, in call order); ``lookahead``: L >= 0 batches fetched
    ahead; ``capacity``: most rows held per table and rank (``None``: unbounded). Every
    rank's loader must yield the same number of batches. The results equal synchronous
    training: lookups the schedule did not prepare (evaluation between steps, more calls
    than listed, lookups after leaving the loop) first apply what is outstanding, and
    gradient accumulation over batches is allowed. A pass ends when the loader is
    exhausted, when its iterator is closed or dropped (``break``), or at :meth:`close`;
    its end is local (nothing collective left to do). Collective over the tables' groups.
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
        self.capacity = capacity
        self.tables = list(tables)
        self.groups = _groups(self.tables)
        self.schedules: list[_Schedule] = []  # those of the running pass
        self._active: Any = None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        self.close()  # a new pass ends the previous one
        gen = self._run()
        self._active = weakref.ref(gen)
        return gen

    def close(self) -> None:
        """End the running pass now (as leaving the loop does; local)."""
        gen = self._active() if self._active is not None else None
        self._active = None
        if gen is not None:
            gen.close()

    def _ids(self, batch: Any) -> list[list[torch.Tensor]]:
        ids = self.inputs(batch)
        if len(ids) != len(self.tables):
            raise ValueError(f"LookaheadLoader: 'inputs' returned {len(ids)} id tensors for "
                             f"{len(self.tables)} tables")
        return [[ids[p].reshape(-1).long() for p in pos] for _, pos in self.groups]

    def _run(self) -> Iterator[Any]:
        it = iter(self.loader)
        window: deque = deque()
        entered = 0
        exhausted = False
        s = 0
        current: list[tuple[Any, list]] = []
        self.schedules = [_Schedule(m, self.lookahead, self.capacity) for m, _ in self.groups]
        try:
            while True:
                # the window holds batches s .. s + L + 1 (their ids known on every rank)
                while entered <= s + self.lookahead + 1:
                    batch, ids = None, None
                    if not exhausted:
                        try:
                            batch = next(it)
                        except StopIteration:
                            exhausted = True
                    if batch is not None:
                        ids = self._ids(batch)
                        window.append((batch, ids))
                    for k, sched in enumerate(self.schedules):
                        sched.enter(entered, None if ids is None else torch.cat(ids[k]))
                    entered += 1
                if not window:
                    return
                batch, ids = window.popleft()
                current = []
                for sched, flats in zip(self.schedules, ids):
                    sched.fetch_round(s)
                    sched.batch = s
                    lookups = sched.serve(s, flats)
                    sched.module._schedule(lookups)
                    current.append((sched.module, lookups))
                yield batch
                _end_batch(current, "LookaheadLoader", s)
                current = []
                s += 1
        finally:
            for module, lookups in current:
                module._unschedule(lookups)
            for sched in self.schedules:
                sched.close()


def _groups(tables: Sequence[Any]) -> list[tuple[Any, list[int]]]:
    """The distinct modules of ``tables`` (first appearance order) and the positions of
    each one's entries."""
    out: list[tuple[Any, list[int]]] = []
    for p, t in enumerate(tables):
        for m, pos in out:
            if m is t:
                pos.append(p)
                break
        else:
            out.append((t, [p]))
    return out


def _end_batch(current: Sequence[tuple[Any, list]], who: str, s: int) -> None:
    """The loader moves on: drop the batch's prepared lookups its forward did not use."""
    for module, lookups in current:
        unused = module._unschedule(lookups)
        if unused:
            warnings.warn(f"{who}: batch {s} used {len(lookups) - unused} of the "
                          f"{len(lookups)} lookups of {module._name} that 'inputs' "
                          f"listed; the rest were dropped", RuntimeWarning, stacklevel=3)
