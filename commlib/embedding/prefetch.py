"""Persia's hybrid schedule: lookups of the next batches issued ahead of the dense step."""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch


class PrefetchLoader:
    """Iterate ``loader`` while the embedding lookups of up to ``depth`` later batches are
    already issued (their rows travel while the current batch trains).

    ``tables``: the sharded modules; ``inputs(batch)`` returns one id tensor per table
    (what is passed as ``input`` to that module for this batch). ``depth`` defaults to the
    smallest ``staleness`` of the tables: reading batch ``b + depth`` while batch ``b``
    trains leaves ``depth`` batches read but not applied, the most the tables allow. Each
    training batch must call each table exactly once, in the loader's order, and every
    rank must get the same number of batches (the lookups are collective).
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

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        ahead: deque = deque()
        exhausted = False
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
                for table, x in zip(self.tables, ids):
                    table.prefetch(x)
                ahead.append(batch)
            if not ahead:
                return
            yield ahead.popleft()
