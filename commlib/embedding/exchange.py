"""Moving ids, rows and row gradients between ranks: row ``i`` of a table is owned by rank
``i % n`` of the group, at local row ``i // n`` (the cyclic sharding).

Every function here is collective over the group (all ranks call it, in the same order) and
goes through commlib's ``alltoall``/``alltoall_v`` (bytes show in ``commlib.stats()``).
"""
from __future__ import annotations

from typing import Any

import torch

from ..primitives import alltoall, alltoall_v


def route(ids: torch.Tensor, n: int) -> tuple[torch.Tensor, list[int]]:
    """Order of ``ids`` grouped by owner (stable) and the count per owner.

    ``ids``: 1-D int64. Returns ``(perm, splits)``: ``ids[perm]`` lists the ids of owner 0,
    then owner 1, ...; ``splits[j]`` is how many go to owner ``j``."""
    owner = torch.remainder(ids, n)
    perm = torch.argsort(owner, stable=True)
    splits = torch.bincount(owner, minlength=n).tolist()
    return perm, splits


def exchange_counts(splits: list[int], group: Any) -> list[int]:
    """``recv[i]`` = what rank ``i`` sends here (one small alltoall of int64)."""
    return alltoall(torch.tensor(splits, dtype=torch.int64), group=group).tolist()


class Request:
    """The ids one rank asks of the owners, routed: ``sent`` (ids in owner order),
    ``perm`` (positions in the caller's order), the splits both ways, and ``asked`` (the ids
    other ranks ask of this rank, grouped by asking rank)."""

    __slots__ = ("ids", "perm", "send_splits", "recv_splits", "asked")

    def __init__(self, ids: torch.Tensor, group: Any, n: int) -> None:
        self.ids = ids
        self.perm, self.send_splits = route(ids, n)
        self.recv_splits = exchange_counts(self.send_splits, group)
        self.asked = alltoall_v(ids[self.perm], self.send_splits, self.recv_splits,
                                group=group)


def reply(req: Request, rows: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """Send ``rows`` (one per id in ``req.asked``, in that order) back to the askers;
    the result (or, with ``async_op``, a Work whose result is) holds the rows in owner order
    (use :func:`unroute` for the caller's order)."""
    return alltoall_v(rows, req.recv_splits, req.send_splits, group=group, async_op=async_op)


def unroute(req: Request, routed: torch.Tensor) -> torch.Tensor:
    """Rows in owner order back to the order of ``req.ids``."""
    out = torch.empty_like(routed)
    out[req.perm] = routed
    return out
