"""4-bit min-max quantization and the allreduce that moves it (``streaming_diloco``'s
``quantize="int4"``), written with torch operations (CPU and CUDA alike).

Codec: a flat float32 vector in chunks of ``chunk_size`` elements (the last one padded
with its last value); per chunk its min ``lo`` and max ``hi`` (two float32) and one code
``round((x - lo) / (hi - lo) * 15)`` in 0..15 per element, two codes per byte (element
``2i`` in the low nibble). Decoding gives ``lo + code * (hi - lo) / 15``: an error of at
most ``(hi - lo) / 30`` per element. A chunk holding NaN or Inf decodes to NaN entirely.

:func:`allreduce` averages in place with the scheme of the compressed allreduce
(:mod:`commlib.primitives.compressed`): the input padded to ``n * P`` (``P`` = ``ceil(L /
n)``, edge value), each rank compresses its ``n`` parts, an alltoall hands part ``j`` to
rank ``j``, which decodes the ``n`` versions, adds them in rank order, divides by ``n`` and
compresses the result; an allgather of those and every rank decodes all of them. Every
rank ends with bitwise the same values; on the wire about ``2 (n-1)/n * (L/2 + 8 L /
chunk_size)`` bytes per rank: ``1/8`` of a float32 allreduce plus the chunks' headers.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..primitives import allgather, alltoall

LEVELS = 15


def _chunked(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``(rows, chunks, chunk_size)`` float32: each row of ``x`` (2-D) padded with its last
    value to whole chunks."""
    rows, length = x.shape
    chunks = max(1, math.ceil(length / chunk_size))
    pad = chunks * chunk_size - length
    if pad:
        x = torch.cat([x, x[:, -1:].expand(rows, pad)], dim=1)
    return x.reshape(rows, chunks, chunk_size)


def nbytes(length: int, chunk_size: int) -> int:
    """Bytes of one compressed row of ``length`` elements."""
    chunks = max(1, math.ceil(length / chunk_size))
    return chunks * 8 + chunks * ((chunk_size + 1) // 2)


def compress(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Each row of the 2-D ``x`` as ``nbytes(x.shape[1])`` uint8 (headers, then codes)."""
    if chunk_size % 2:
        raise ValueError(f"int4.compress: chunk_size must be even, got {chunk_size}")
    c = _chunked(x.float(), chunk_size)
    lo, hi = c.amin(dim=2, keepdim=True), c.amax(dim=2, keepdim=True)
    bad = ~(torch.isfinite(lo) & torch.isfinite(hi))
    span = hi - lo
    scale = torch.where(span > 0, LEVELS / span, torch.zeros_like(span))
    codes = torch.round((c - lo) * scale).clamp_(0, LEVELS)
    codes = torch.where(bad | ~torch.isfinite(codes), torch.zeros_like(codes), codes)
    codes = codes.to(torch.uint8).reshape(c.shape[0], c.shape[1], -1, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).reshape(c.shape[0], -1)
    lo = torch.where(bad, torch.full_like(lo, float("nan")), lo)
    header = torch.cat([lo, hi], dim=2).reshape(c.shape[0], -1).contiguous()
    return torch.cat([header.view(torch.uint8), packed], dim=1)


def decompress(buf: torch.Tensor, length: int, chunk_size: int) -> torch.Tensor:
    """Inverse of :func:`compress`: ``(rows, length)`` float32."""
    rows, chunks = buf.shape[0], max(1, math.ceil(length / chunk_size))
    header = buf[:, :chunks * 8].contiguous().view(torch.float32).reshape(rows, chunks, 2)
    lo, hi = header[..., :1], header[..., 1:]
    packed = buf[:, chunks * 8:].reshape(rows, chunks, -1)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(rows, chunks, -1)
    values = lo + codes.float() * ((hi - lo) / LEVELS)
    return values.reshape(rows, -1)[:, :length]


def _parts(flat: torch.Tensor, n: int) -> torch.Tensor:
    """``(n, P)``: ``flat`` padded with its last value to ``n * P``."""
    part = max(1, math.ceil(flat.numel() / n))
    pad = n * part - flat.numel()
    if pad:
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    return flat.reshape(n, part)


def roundtrip(x: torch.Tensor, chunk_size: int, n: int) -> torch.Tensor:
    """``x`` as the other ranks decode this rank's contribution to :func:`allreduce` over
    ``n`` ranks (its parts compressed and decompressed), shaped and typed like ``x``."""
    flat = x.detach().reshape(-1).float()
    parts = _parts(flat, n)
    out = decompress(compress(parts, chunk_size), parts.shape[1], chunk_size)
    return out.reshape(-1)[:flat.numel()].view(x.shape).to(x.dtype)


def allreduce(tensor: torch.Tensor, group: Any, chunk_size: int = 2048) -> torch.Tensor:
    """Average ``tensor`` (float, any shape) over ``group`` in place through 4-bit codes
    (module docstring). Collective: every rank passes the same shape and dtype."""
    n = group.size
    if n == 1:
        return tensor
    flat = tensor.detach().reshape(-1).float()
    parts = _parts(flat, n)
    part = parts.shape[1]
    received = alltoall(compress(parts, chunk_size), group=group)
    mine = decompress(received, part, chunk_size)
    reduced = mine[0].clone()
    for row in mine[1:]:
        reduced += row
    reduced /= n
    gathered = allgather(compress(reduced.unsqueeze(0), chunk_size)[0], group=group)
    result = decompress(gathered, part, chunk_size).reshape(-1)[:flat.numel()]
    with torch.no_grad():
        tensor.copy_(result.view(tensor.shape))
    return tensor
