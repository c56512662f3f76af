"""Construction-time check that every rank wraps the same model."""
from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch

from ..base.errors import CommError
from ..primitives import allgather, allgather_v


def describe(module: torch.nn.Module, ignore: set[str] = frozenset()) -> list[list[Any]]:
    """(kind, name, shape, dtype, requires_grad) of every parameter and buffer not in
    ``ignore``, in registration order."""
    rows = [["parameter", n, list(p.shape), str(p.dtype), p.requires_grad]
            for n, p in module.named_parameters() if n not in ignore]
    rows += [["buffer", n, list(b.shape), str(b.dtype), False]
             for n, b in module.named_buffers() if n not in ignore]
    return rows


def check_same_model(module: torch.nn.Module, group: Any,
                     ignore: set[str] = frozenset()) -> None:
    """Collective over ``group``: raise :class:`CommError` on every rank, naming the first
    difference, unless all ranks have the same parameter/buffer names, shapes, dtypes and
    ``requires_grad`` (which decides what the buckets hold)."""
    rows = describe(module, ignore)
    encoded = json.dumps(rows).encode()
    digest = np.frombuffer(hashlib.sha256(encoded).digest(), dtype=np.uint8)
    digests = allgather(digest, group=group)
    if (digests == digests[0]).all():
        return
    everyone = allgather_v(np.frombuffer(encoded, dtype=np.uint8), group=group)
    models = [json.loads(bytes(m)) for m in everyone]
    raise CommError(_first_difference(models, group.rank))


def _first_difference(models: list[list[Any]], rank: int) -> str:
    reference = models[0]
    for r, rows in enumerate(models[1:], start=1):
        for i in range(max(len(reference), len(rows))):
            a = reference[i] if i < len(reference) else None
            b = rows[i] if i < len(rows) else None
            if a != b:
                return (f"commlib.DistributedDataParallel (rank {rank}): ranks wrap different "
                        f"models; entry {i}: rank 0 has {_fmt(a)}, rank {r} has {_fmt(b)}")
    return f"commlib.DistributedDataParallel (rank {rank}): ranks wrap different models"


def _fmt(row: Any) -> str:
    if row is None:
        return "nothing"
    kind, name, shape, dtype, requires_grad = row
    frozen = "" if requires_grad or kind == "buffer" else " (requires_grad=False)"
    return f"{kind} {name!r} shape {tuple(shape)} {dtype}{frozen}"
