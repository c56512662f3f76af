"""Buckets: flat buffers per dtype and device that tensors (gradients, weights, optimizer
state) view into, so one collective moves many tensors and no copy is made per step where
the layout allows."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

MB = 1 << 20
FIRST_BUCKET_BYTES = 1 * MB  # the first bucket is small so communication starts early


class Bucket:
    """Tensors of one dtype and device packed into ``flat`` (1-D), in ``names`` order.

    ``views[i]`` is the slice of ``flat`` shaped like tensor ``i``; ``index`` is the launch
    order (every rank launches buckets in increasing index). ``sources[i]``: during a
    backward pass whose copies an algorithm fuses into its exchange
    (:attr:`commlib.algorithms.Algorithm.fuses_bucket_copy`), the gradient autograd made
    for tensor ``i``, not yet copied into ``views[i]`` (``None``: ``views[i]`` holds it);
    ``deferred`` counts them.
    """

    def __init__(self, index: int, names: Sequence[str], tensors: Sequence[torch.Tensor]):
        self.index = index
        self.names = list(names)
        self.tensors = list(tensors)
        first = tensors[0]
        self.dtype, self.device = first.dtype, first.device
        self.numels = [t.numel() for t in tensors]
        self.offsets = [sum(self.numels[:i]) for i in range(len(tensors))]
        self.flat = torch.zeros(sum(self.numels), dtype=self.dtype, device=self.device)
        self.views = [self.flat[o:o + n].view_as(t)
                      for o, n, t in zip(self.offsets, self.numels, tensors)]
        self.pending = len(tensors)
        self.sources: list[torch.Tensor | None] = [None] * len(tensors)
        self.deferred = 0

    def pieces(self) -> list[torch.Tensor]:
        """Tensor ``i``'s gradient where it lies: ``sources[i]`` if deferred, else
        ``views[i]`` (their concatenation is what ``flat`` stands for)."""
        return [v if s is None else s for s, v in zip(self.sources, self.views)]

    def fill(self) -> None:
        """Copy the deferred gradients into their views (``flat`` then holds them all)."""
        if self.deferred:
            for i, source in enumerate(self.sources):
                if source is not None:
                    self.views[i].copy_(source)
            self.clear_sources()

    def clear_sources(self) -> None:
        if self.deferred:
            self.sources = [None] * len(self.tensors)
            self.deferred = 0

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        return (f"<Bucket {self.index}: {len(self)} tensors, {self.nbytes} bytes, "
                f"{self.dtype}, {self.device}>")


def plan(named: Iterable[tuple[str, torch.Tensor]], cap_bytes: int | Sequence[int],
         first_cap_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Group tensors (given in registration order) into buckets, in reverse order.

    Backward produces gradients roughly in reverse registration order, so buckets are
    filled from the last tensor backwards; a bucket holds one dtype and device and closes
    when it would exceed ``cap_bytes`` (the smaller of that and ``first_cap_bytes`` for
    the first one). A sequence of caps gives bucket ``k`` the ``k``-th cap (the last one
    repeating) and no special first bucket. Returns the indices (into ``named``) of each
    bucket, buckets in launch order.
    """
    items = list(named)
    caps = None if isinstance(cap_bytes, int) else list(cap_bytes)
    open_: dict[Any, list[int]] = {}
    sizes: dict[Any, int] = {}
    closed: list[list[int]] = []
    for i in reversed(range(len(items))):
        t = items[i][1]
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        if caps is not None:
            cap = caps[min(len(closed), len(caps) - 1)]
        else:
            cap = min(first_cap_bytes, cap_bytes) if not closed else cap_bytes
        if key in open_ and sizes[key] + nbytes > cap:
            closed.append(open_.pop(key))
        if key not in open_:
            open_[key], sizes[key] = [], 0
        open_[key].append(i)
        sizes[key] += nbytes
    closed.extend(open_.values())
    return closed


def build(named: Sequence[tuple[str, torch.Tensor]], cap_bytes: int | Sequence[int],
          first_cap_bytes: int = FIRST_BUCKET_BYTES) -> list[Bucket]:
    """:func:`plan` and allocate: one :class:`Bucket` per group, flat buffers zeroed."""
    groups = plan(named, cap_bytes, first_cap_bytes)
    return [Bucket(k, [named[i][0] for i in idx], [named[i][1] for i in idx])
            for k, idx in enumerate(groups)]


def pack(bucket: Bucket) -> torch.Tensor:
    """Copy the bucket's tensors into ``bucket.flat`` (e.g. a snapshot of weights)."""
    with torch.no_grad():
        for view, t in zip(bucket.views, bucket.tensors):
            view.copy_(t)
    return bucket.flat


def unpack(bucket: Bucket) -> None:
    """Copy ``bucket.flat`` back into the bucket's tensors, in place."""
    with torch.no_grad():
        for view, t in zip(bucket.views, bucket.tensors):
            t.copy_(view)
