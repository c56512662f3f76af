"""Persia's hybrid schedule: lookups of the next batches issued ahead of the dense step."""
from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from .lookahead import _end_batch, _groups


class PrefetchLoader:
    """Iterate ``loader`` while the embedding lookups of up to ``depth`` later batches are
    already issued (their rows travel while the current batch trains).

    ``tables``: the sharded modules (one module may appear several times: one entry per
    lookup of a batch); ``inputs(batch)`` returns one id tensor per entry (what that
    lookup passes as ``input``, in call order). ``depth`` defaults to the smallest
    ``staleness`` of the tables: reading batch ``b + depth`` while batch ``b`` trains
    leaves ``depth`` batches read but not applied, the most the tables allow. The training
    lookups (grad enabled, module in training mode) of each batch take its prepared
    lookups in order; every other lookup (evaluation, ``no_grad``, more calls than listed)
    fetches its rows itself. Prepared lookups a batch did not use are dropped (with a
    warning) when the loader moves on; those of the batches ahead when the pass ends: the
    loader exhausted, its iterator closed or dropped (``break``), :meth:`close`, or the
    table's ``flush()``. Every rank must get the same number of batches (the lookups are
    collective); ending a pass is local.
    """

    def __init__(self, loader: Iterable, tables: Sequence[Any],
                 inputs: Callable[[Any], Sequence[torch.Tensor]],
                 depth: int | None = None) -> None:
        self.loader, self.tables, self.inputs = loader, list(tables), inputs
        tau = min(t.table.staleness for t in self.tables) if self.tables else 0
        if depth is None:
            depth = tau
        if not isinstance(depth, int) or not 0 <= depth <= tau:
            raise ValueError(f"PrefetchLoader: argument 'depth' must be an int in [0, {tau}] "
                             f"(the tables' staleness), got {depth!r}")
        self.depth = depth
        self.groups = _groups(self.tables)
        self._active: Any = None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        self.close()  # a new pass ends the previous one
        gen = self._run()
        self._active = weakref.ref(gen)
        return gen

    def close(self) -> None:
        """End the running pass now, as leaving the loop does: its prepared lookups are
        released (local)."""
        gen = self._active() if self._active is not None else None
        self._active = None
        if gen is not None:
            gen.close()

    def _run(self) -> Iterator[Any]:
        it = iter(self.loader)
        ahead: deque = deque()  # (batch, [(module, lookups)]) issued, not yet yielded
        current: list = []
        exhausted = False
        s = 0
        try:
            while True:
                while not exhausted and len(ahead) <= self.depth:
                    try:
                        batch = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                    ids = self.inputs(batch)
                    if len(ids) != len(self.tables):
                        raise ValueError(f"PrefetchLoader: 'inputs' returned {len(ids)} id "
                                         f"tensors for {len(self.tables)} tables")
                    # trained len(ahead) batches after the open one
                    prepared = [(m, m._prefetch([ids[p] for p in pos], len(ahead)))
                                for m, pos in self.groups]
                    ahead.append((batch, prepared))
                if not ahead:
                    return
                batch, current = ahead.popleft()
                for module, lookups in current:
                    module._schedule(lookups)
                yield batch
                _end_batch(current, "PrefetchLoader", s)
                current = []
                s += 1
        finally:
            for _, prepared in [(None, current)] + list(ahead):
                for module, lookups in prepared:
                    module._unschedule(lookups)
