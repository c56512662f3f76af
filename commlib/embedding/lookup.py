"""One lookup of a sharded table: its ids, where its rows come from, and the autograd node
that hands the rows' gradient to the table's open batch."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class Lookup:
    """One lookup: the sorted unique ids of the flattened input (``key``), the position of
    every input entry in them (``inverse``) and the rows (fetched now, or later through
    ``resolve()`` when the fetch was prefetched in the background)."""

    __slots__ = ("table", "ids", "inverse", "rows", "_get", "key", "released")

    def __init__(self, table: Any, flat: torch.Tensor) -> None:
        self.table = table
        self.key = flat
        self.ids, self.inverse = torch.unique(flat, sorted=True, return_inverse=True)
        self.rows: torch.Tensor | None = None
        self._get: Callable[[], torch.Tensor] | None = None
        self.released = False

    def resolve(self) -> torch.Tensor:
        """The rows (waits for a background fetch; local)."""
        if self.rows is None:
            self.rows = self._get()
            self._get = None
        return self.rows

    def release(self) -> None:
        """Drop a prepared lookup nobody will use: complete its fetch (local: the
        collective was issued on every rank) so no request or buffer is left behind."""
        if self._get is not None:
            self._get()
            self._get = None
        self.rows = None
        self.released = True

    def padding(self, padding_idx: int | None) -> int | None:
        """``padding_idx``'s position among the fetched rows, or None when absent."""
        if padding_idx is None or not len(self.ids):
            return None
        pos = int(torch.searchsorted(self.ids, padding_idx))
        if pos < len(self.ids) and int(self.ids[pos]) == padding_idx:
            return pos
        return None


class Rows(torch.autograd.Function):
    """The fetched rows as a leaf of the graph: their gradient goes to the table's open
    batch (every backward pass, every lookup: summed there, as torch sums ``.grad``)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, lookup: Lookup,  # type: ignore[override]
                padding_idx: int | None) -> torch.Tensor:
        ctx.lookup, ctx.padding_idx = lookup, padding_idx
        return lookup.rows

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:  # type: ignore[override]
        lookup = ctx.lookup
        if grad.is_sparse:
            # torch's sparse embedding backward: one value per use, none for the padding
            # row; coalesce sums them per row as torch.optim does on a sparse=True grad
            grad = grad.coalesce()
            ids, values = lookup.ids[grad.indices()[0]], grad.values()
        else:  # mode="max" (dense): every looked-up row but the padding one
            ids, values = lookup.ids, grad
            if ctx.padding_idx is not None:
                keep = ids != ctx.padding_idx
                ids, values = ids[keep], values[keep]
        lookup.table.accumulate(ids, values)
        return None, None, None
