"""4-bit min-max quantization and the allreduce that moves it (``streaming_diloco``'s
``quantize="int4"``), CPU and CUDA alike.

Codec: a flat float32 vector in chunks of ``chunk_size`` elements (even; the last one
padded with its last value); per chunk its min ``lo`` and max ``hi`` (two float32, ``-0.0``
stored as ``+0.0``) and one code ``rint(((x - lo) * pre) * (15 / ((hi - lo) * pre)))`` in
0..15 per element (``pre = 2**64`` for ranges under ``2**-64``, else 1; all codes 0 for a
constant chunk), two codes per byte (element ``2i`` in the low nibble). Decoding gives
``min(lo + code * ((hi - lo) / 15), hi)``: an error of at most ``(hi - lo) / 30`` per
element plus rounding. A chunk holding NaN or Inf, or whose ``hi - lo`` overflows, is
stored as ``lo = hi = NaN`` with codes 0 and decodes to NaN entirely.

Two implementations give the same bytes: ``commlib.kernels`` (Numba, CPU and CUDA;
layout ``minmax_int4``, whose sections are this format) wherever it runs, and torch
operations otherwise (``impl="torch"``, e.g. on a GPU without ``numba-cuda``). On a GPU
the decoded values may differ in the last bit where the compiler fuses the multiply-add.

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
IMPLS = (None, "torch", "kernels")


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


def _use_kernels(x: torch.Tensor, impl: str | None) -> bool:
    """Whether ``impl`` (None: where they run) sends ``x`` through ``kernels``; imported
    here, so that neither Numba nor its CUDA target loads before it is used."""
    if impl not in IMPLS:
        raise ValueError(f"int4: impl must be one of {IMPLS}, got {impl!r}")
    if impl is not None:
        return impl == "kernels"
    if x.device.type not in ("cpu", "cuda"):
        return False
    try:
        from .. import kernels  # noqa: F401
        if x.device.type == "cuda":
            from ..kernels._cuda import load_cuda
            load_cuda()
    except (ImportError, RuntimeError):
        return False
    return True


def _compress_torch(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    c = _chunked(x, chunk_size)
    lo = c.amin(dim=2, keepdim=True) + 0.0
    hi = c.amax(dim=2, keepdim=True) + 0.0
    span = hi - lo
    bad = ~(torch.isfinite(lo) & torch.isfinite(hi) & torch.isfinite(span))
    pre = torch.where(span < 2.0 ** -64, torch.full_like(span, 2.0 ** 64),
                      torch.ones_like(span))
    scale = torch.where(span > 0, LEVELS / (span * pre), torch.zeros_like(span))
    codes = torch.round(((c - lo) * pre) * scale).clamp_(0, LEVELS)
    codes = torch.where(bad, torch.zeros_like(codes), codes)
    codes = codes.to(torch.uint8).reshape(c.shape[0], c.shape[1], -1, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).reshape(c.shape[0], -1)
    nan = torch.full_like(lo, float("nan"))
    header = torch.cat([torch.where(bad, nan, lo), torch.where(bad, nan, hi)], dim=2)
    header = header.reshape(c.shape[0], -1).contiguous()
    return torch.cat([header.view(torch.uint8), packed], dim=1)


def compress(x: torch.Tensor, chunk_size: int, impl: str | None = None) -> torch.Tensor:
    """Each row of the 2-D ``x`` as ``nbytes(x.shape[1])`` uint8 (headers, then codes), on
    ``x``'s device; ``impl``: ``"kernels"``, ``"torch"`` or None (kernels where they run).
    Both give the same bytes."""
    if chunk_size % 2:
        raise ValueError(f"int4.compress: chunk_size must be even, got {chunk_size}")
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"int4.compress: x must be 2-D with rows of >= 1 element, got "
                         f"shape {tuple(x.shape)}")
    x = x.float()
    if not _use_kernels(x, impl):
        return _compress_torch(x, chunk_size)
    from .. import kernels
    rows, length = x.shape
    size = kernels.compressed_nbytes(length, chunk_size, kernels.MINMAX_INT4)
    full = torch.empty((rows, size), dtype=torch.uint8, device=x.device)
    x = x.contiguous()
    for r in range(rows):
        kernels.quantize_minmax_int4(x[r], chunk_size, out=full[r], nonfinite="nan")
    return full[:, 32:32 + nbytes(length, chunk_size)].contiguous()


def decompress(buf: torch.Tensor, length: int, chunk_size: int,
               impl: str | None = None) -> torch.Tensor:
    """Inverse of :func:`compress`: ``(rows, length)`` float32 on ``buf``'s device."""
    rows, chunks = buf.shape[0], max(1, math.ceil(length / chunk_size))
    if _use_kernels(buf, impl):
        from .. import kernels
        size = kernels.compressed_nbytes(length, chunk_size, kernels.MINMAX_INT4)
        full = torch.zeros((rows, size), dtype=torch.uint8, device=buf.device)
        full[:, :32] = torch.from_numpy(kernels.header_bytes(length, chunk_size)).to(
            buf.device)
        full[:, 32:32 + buf.shape[1]] = buf
        out = torch.empty((rows, length), dtype=torch.float32, device=buf.device)
        for r in range(rows):
            kernels.dequantize_minmax_int4(full[r], out=out[r])
        return out
    # a fresh copy: a 1-row slice can be "contiguous" with a row stride not divisible by 4
    header = buf.new_empty((rows, chunks * 8)).copy_(buf[:, :chunks * 8])
    header = header.view(torch.float32).reshape(rows, chunks, 2)
    lo, hi = header[..., :1], header[..., 1:]
    packed = buf[:, chunks * 8:].reshape(rows, chunks, -1)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(rows, chunks, -1)
    values = lo + codes.float() * ((hi - lo) / LEVELS)
    values = torch.where(values < hi, values, hi)  # as the kernels: NaN chunks give hi
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
