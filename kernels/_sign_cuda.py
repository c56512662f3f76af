"""CUDA kernels for 1-bit sign compression with error feedback; see ``_arith``.

``_scales_kernel`` uses one warp per chunk: lane ``j`` sums ``|v|`` over elements
``j, j + 32, ...`` of the chunk in order, and the warp folds the 32 partial sums with the
fixed tree of ``_arith``, exactly as the CPU twin does. Packing and unpacking are
one thread per output byte and one thread per element.
"""
from __future__ import annotations

import numpy as np

from ._arith import ELEMENT_BLOCK, F0, INF, LANES, NON_FINITE, OK, WARPS_PER_BLOCK
from ._cuda import load_cuda

cuda = load_cuda()


@cuda.jit
def _scales_kernel(x, residual, chunk_size, scales, status):
    lane = cuda.threadIdx.x % LANES
    warp = cuda.threadIdx.x // LANES
    c = cuda.blockIdx.x * WARPS_PER_BLOCK + warp
    acc_s = cuda.shared.array((WARPS_PER_BLOCK, LANES), np.float32)
    start = c * chunk_size
    stop = min(start + chunk_size, x.shape[0])
    acc = F0
    for i in range(start + lane, stop, LANES):
        acc += abs(x[i] + residual[i])
    acc_s[warp, lane] = acc
    half = LANES // 2
    while half > 0:
        cuda.syncthreads()
        if lane < half:
            acc_s[warp, lane] += acc_s[warp, lane + half]
        half //= 2
    cuda.syncthreads()
    if lane == 0 and c < scales.shape[0]:
        scale = acc_s[warp, 0] / np.float32(stop - start)
        scales[c] = scale
        status[c] = OK if scale < INF else NON_FINITE


@cuda.jit
def _pack_kernel(x, residual, residual_out, chunk_size, scales, bits, bits_stride):
    g = cuda.grid(1)
    c = g // bits_stride
    if c >= scales.shape[0]:
        return
    chunk_start = c * chunk_size
    start = chunk_start + (g - c * bits_stride) * 8
    stop = min(min(chunk_start + chunk_size, x.shape[0]), start + 8)
    if start >= stop:
        return
    scale = scales[c]
    byte = 0
    for i in range(start, stop):
        v = x[i] + residual[i]
        negative = v < F0
        if negative:
            byte |= 1 << (i - start)
        residual_out[i] = v - (-scale if negative else scale)
    bits[g] = byte


@cuda.jit
def _unpack_kernel(scales, bits, chunk_size, bits_stride, out):
    i = cuda.grid(1)
    if i >= out.shape[0]:
        return
    c = i // chunk_size
    k = i - c * chunk_size
    negative = (bits[c * bits_stride + (k >> 3)] >> (k & 7)) & 1
    scale = scales[c]
    out[i] = -scale if negative else scale


def chunk_scales(x, residual, chunk_size: int, scales, status) -> None:
    """Device arrays: ``x``, ``residual`` (numel,) float32 in (read only);
    ``scales`` (nchunks,) float32 and ``status`` (nchunks,) uint8 out."""
    nchunks = scales.shape[0]
    if nchunks:
        grid = -(-nchunks // WARPS_PER_BLOCK)
        _scales_kernel[grid, WARPS_PER_BLOCK * LANES](x, residual, chunk_size, scales, status)


def pack_signs(x, residual, residual_out, chunk_size: int, scales, bits,
               bits_stride: int) -> None:
    """Device arrays: writes ``bits`` and the updated residual into ``residual_out``
    (which may be ``residual``: in place)."""
    nbytes = scales.shape[0] * bits_stride
    if nbytes:
        grid = -(-nbytes // ELEMENT_BLOCK)
        _pack_kernel[grid, ELEMENT_BLOCK](x, residual, residual_out, chunk_size, scales, bits,
                                          bits_stride)


def unpack_signs(scales, bits, chunk_size: int, bits_stride: int, out) -> None:
    """Device arrays: ``scales`` and ``bits`` in, ``out`` (numel,) float32 out."""
    if out.shape[0]:
        grid = -(-out.shape[0] // ELEMENT_BLOCK)
        _unpack_kernel[grid, ELEMENT_BLOCK](scales, bits, chunk_size, bits_stride, out)
