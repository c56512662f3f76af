"""What one rank announces in a negotiation round, as bytes (one slot of the round's
allgather; :mod:`commlib.horovod.controller`).

A slot's content (after the controller's 4-byte length) is empty when the rank has
nothing to say, else:

* a header ``<BHI``: the rank's flags (1 joined, 2 shutting down), the number of cached
  announcements, the length of the pickled new ones;
* the cached announcements: ``uint32`` response-cache ids (a name and metadata pair that
  ran before: four bytes each, no pickle);
* the new announcements, each as ``<H`` name length, the UTF-8 name, ``<H`` metadata
  length, the pickled metadata (pickled once per distinct metadata: :func:`meta_bytes`);
* inline data: for each announcement (cached ones first, in slot order) of a *tiny*
  allreduce (:func:`inline_nbytes`), the raw bytes of the rank's input. Every rank reduces
  those itself when the operation is ready, so a tiny allreduce costs the round's
  allgather and nothing more (Horovod needs a negotiation and then the data exchange).
"""
from __future__ import annotations

import pickle
import struct
from typing import Any

import numpy as np
import torch

HEADER = struct.Struct("<BHI")
INLINE_MAX_BYTES = 128
# dtypes whose inline reduction is bit-identical to the data group's (MPI's native
# reductions, and the float32/float64 rank-order sums Horovod's tests expect)
_INLINE_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int8": torch.int8,
                  "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32,
                  "int64": torch.int64}
_INLINE_OPS = (0, 1, 3, 4, 5)   # Average, Sum, Min, Max, Product (not Adasum)
_inline_memo: dict = {}


def inline_nbytes(meta: tuple) -> int:
    """Bytes a rank sends inline for an announcement with this metadata (0: none). The
    same on every rank for the same metadata, so every rank parses every slot alike."""
    n = _inline_memo.get(meta)
    if n is None:
        n = 0
        if meta[0] == "allreduce" and meta[1] in _INLINE_OPS and len(meta[4]) == 1:
            dtype, shape, dev = meta[4][0]
            if dev == "cpu" and dtype in _INLINE_DTYPES:
                numel = 1
                for d in shape:
                    numel *= d
                n = numel * _INLINE_DTYPES[dtype].itemsize
                if n > INLINE_MAX_BYTES:
                    n = 0
        if len(_inline_memo) < 4096:
            _inline_memo[meta] = n
    return n


_NUMPY = {name: np.dtype(name) for name in _INLINE_DTYPES}


def inline_numpy_dtype(meta: tuple) -> np.dtype:
    return _NUMPY[meta[4][0][0]]


def prefix_len(payload: bytes) -> int:
    """Bytes of ``payload`` before its inline data."""
    if not payload:
        return 0
    _, ncid, npk = HEADER.unpack_from(payload, 0)
    return HEADER.size + 4 * ncid + npk


_meta_memo: dict = {}
_meta_loads: dict = {}
_H = struct.Struct("<H")


def meta_bytes(meta: tuple) -> bytes:
    """The pickled ``meta`` (memoized: the same bytes on every rank for equal metadata)."""
    b = _meta_memo.get(meta)
    if b is None:
        b = pickle.dumps(meta, protocol=4)
        if len(_meta_memo) < 4096:
            _meta_memo[meta] = b
    return b


def announcement(name: str, mb: bytes) -> bytes:
    """One new announcement: ``name`` and its pickled metadata ``mb``."""
    nb = name.encode()
    return b"".join((_H.pack(len(nb)), nb, _H.pack(len(mb)), mb))


def encode(flags: int, cached: list, new: list) -> bytes:
    """``cached``: ``(cid, request)``; ``new``: requests. Empty bytes when there is
    nothing to announce."""
    if not (flags or cached or new):
        return b""
    pk = b"".join(announcement(r.name, meta_bytes(r.meta)) for r in new)
    parts = [HEADER.pack(flags, len(cached), len(pk))]
    if cached:
        parts.append(struct.pack(f"<{len(cached)}I", *(cid for cid, _ in cached)))
    parts.append(pk)
    for r in [r for _, r in cached] + new:
        if inline_nbytes(r.meta):
            parts.append(r.inputs[0].detach().numpy().tobytes())
    return b"".join(parts)


def decode(data: Any) -> tuple:
    """``(flags, cache ids, [(name, meta)], offset of the inline data)``."""
    if not data:
        return 0, (), (), 0
    flags, ncid, npk = HEADER.unpack_from(data, 0)
    o = HEADER.size
    cids = struct.unpack_from(f"<{ncid}I", data, o) if ncid else ()
    o += 4 * ncid
    end = o + npk
    new = []
    while o < end:
        (k,) = _H.unpack_from(data, o)
        name = bytes(data[o + 2:o + 2 + k]).decode()
        o += 2 + k
        (k,) = _H.unpack_from(data, o)
        mb = bytes(data[o + 2:o + 2 + k])
        o += 2 + k
        meta = _meta_loads.get(mb)
        if meta is None:
            meta = pickle.loads(mb)
            if len(_meta_loads) < 4096:
                _meta_loads[mb] = meta
        new.append((name, meta))
    return flags, cids, new, end
