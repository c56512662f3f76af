"""Helpers for :meth:`Algorithm.state_dict` / :meth:`Algorithm.load_state_dict`: CPU copies
that ``torch.save`` writes, and checks that name what differs when a saved state does not
fit the algorithm it is loaded into.

A loader first checks everything it will restore (:func:`check_tensor`, :func:`check_same`)
and only then writes (:func:`copy_into`, :func:`restore`), so a state that does not fit
raises ``ValueError`` and changes nothing.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .buckets import Bucket


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor replaced by a detached CPU copy (dicts, lists and tuples are
    walked; other values are returned as they are). The copies share no memory with the
    originals, so later training does not change a state already taken."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def check_same(where: str, what: str, saved: Any, current: Any) -> None:
    """``ValueError`` naming ``what`` unless ``saved == current``."""
    if saved != current:
        raise ValueError(f"{where}: {what} differs: the saved state has {saved!r}, this run "
                         f"has {current!r}")


def check_tensor(where: str, what: str, saved: Any, like: torch.Tensor | tuple,
                 dtype: torch.dtype | None = None) -> None:
    """``ValueError`` naming ``what`` unless ``saved`` is a tensor of ``like``'s shape (a
    tensor or a shape tuple) and dtype (``dtype`` when given, else ``like``'s)."""
    shape = tuple(like.shape) if isinstance(like, torch.Tensor) else tuple(like)
    dtype = dtype if dtype is not None else getattr(like, "dtype", None)
    if not isinstance(saved, torch.Tensor):
        raise ValueError(f"{where}: {what} must be a tensor, the saved state has "
                         f"{type(saved).__name__}")
    if tuple(saved.shape) != shape:
        raise ValueError(f"{where}: {what} has shape {tuple(saved.shape)} in the saved state, "
                         f"this run expects {shape}")
    if dtype is not None and saved.dtype != dtype:
        raise ValueError(f"{where}: {what} has dtype {saved.dtype} in the saved state, this "
                         f"run expects {dtype}")


def copy_into(dst: torch.Tensor, saved: torch.Tensor) -> None:
    """Write a checked saved tensor into ``dst`` in place (views of ``dst`` see it)."""
    with torch.no_grad():
        dst.copy_(saved)


def restore(saved: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new tensor on ``device`` holding a checked saved tensor."""
    return saved.detach().to(device, copy=True)


def bucket_layout(buckets: Sequence[Bucket]) -> list[list[str]]:
    """The tensor names of each bucket, buckets in index order: saved with bucket-shaped
    state so that a run with other buckets (another ``bucket_cap_mb``, another model)
    is refused by name."""
    return [list(b.names) for b in buckets]


def check_layout(where: str, saved: Any, buckets: Sequence[Bucket]) -> None:
    """``ValueError`` naming the first bucket whose tensors differ from the saved layout."""
    current = bucket_layout(buckets)
    saved = [list(names) for names in saved]
    if len(saved) != len(current):
        raise ValueError(f"{where}: the saved state has {len(saved)} buckets, this run has "
                         f"{len(current)} (same model and bucket_cap_mb?)")
    for k, (a, b) in enumerate(zip(saved, current)):
        if a != b:
            raise ValueError(f"{where}: bucket {k} holds {a} in the saved state, {b} in this "
                             f"run (same model and bucket_cap_mb?)")


def check_keys(where: str, saved: Any, keys: Sequence[str]) -> None:
    """``ValueError`` naming the missing keys unless ``saved`` is a mapping holding ``keys``."""
    if not isinstance(saved, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {type(saved).__name__}")
    missing = [k for k in keys if k not in saved]
    if missing:
        raise ValueError(f"{where}: the saved state lacks {missing}")
