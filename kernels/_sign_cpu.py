"""CPU twin of the 1-bit sign kernels with error feedback (Numba, parallel over chunks).

Compiled code is cached beside this file; see ``_minmax_cpu`` for what the cache keys on.

Compression runs in two passes so that a non-finite chunk is detected before any
residual is touched: ``chunk_scales`` only reads, the caller checks ``status``, and only
then ``pack_signs`` writes the bits and the updated residual (in place, or into a second
buffer so that the caller can still drop the update).
The slice-view and scratch-per-task choices are explained in ``_minmax_cpu``.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._arith import F0, INF, LANES, NON_FINITE, OK


@njit(cache=True, inline="always")
def _chunk_abs_mean(xs, rs, acc):
    """mean |xs + rs| of a non-empty chunk, summed in the order fixed in ``_arith``."""
    acc[:] = F0
    full = xs.size // LANES * LANES
    for base in range(0, full, LANES):
        for j in range(LANES):
            acc[j] += abs(xs[base + j] + rs[base + j])
    for j in range(xs.size - full):
        acc[j] += abs(xs[full + j] + rs[full + j])
    half = LANES // 2
    while half > 0:
        for j in range(half):
            acc[j] += acc[j + half]
        half //= 2
    return acc[0] / np.float32(xs.size)


@njit(parallel=True, cache=True)
def chunk_scales(x, residual, chunk_size, scales, status, ntasks):
    """Fill ``scales`` (nchunks,) float32 with mean |x + residual| per chunk and
    ``status`` (nchunks,) uint8, in ``ntasks`` parallel runs of chunks; reads only."""
    nchunks = scales.shape[0]
    for t in prange(ntasks):
        acc = np.empty(LANES, np.float32)
        for c in range(t * nchunks // ntasks, (t + 1) * nchunks // ntasks):
            start = c * chunk_size
            stop = min(start + chunk_size, x.size)
            scale = _chunk_abs_mean(x[start:stop], residual[start:stop], acc)
            scales[c] = scale
            # The sum is inf/NaN iff some |v| is non-finite (or the sum overflows).
            status[c] = OK if scale < INF else NON_FINITE


@njit(cache=True, inline="always")
def _pack_byte(xs, rs, ro, k, count, scale):
    """Bits of elements ``k .. k + count - 1`` of the chunk; writes their new residuals
    into ``ro`` (which may be ``rs``: each element is read before it is written)."""
    byte = 0
    for b in range(count):
        v = xs[k + b] + rs[k + b]
        negative = v < F0
        byte |= np.int32(negative) << b
        ro[k + b] = v - (-scale if negative else scale)
    return byte


@njit(cache=True, inline="always")
def _pack_chunk(xs, rs, ro, bits, scale):
    full = xs.size // 8 * 8
    # a constant trip count of 8 lets LLVM unroll and vectorize (2x the variable count)
    for k in range(0, full, 8):
        bits[k // 8] = _pack_byte(xs, rs, ro, k, 8, scale)
    if full < xs.size:
        bits[full // 8] = _pack_byte(xs, rs, ro, full, xs.size - full, scale)


@njit(parallel=True, cache=True)
def pack_signs(x, residual, residual_out, chunk_size, scales, bits, bits_stride):
    """Write the sign bits of ``v = x + residual`` into ``bits`` and set
    ``residual_out = v - decompressed`` (all flat, float32; ``residual_out`` may be
    ``residual``: in place)."""
    nchunks = scales.shape[0]
    for c in prange(nchunks):
        start = c * chunk_size
        stop = min(start + chunk_size, x.size)
        off = c * bits_stride
        _pack_chunk(x[start:stop], residual[start:stop], residual_out[start:stop],
                    bits[off:off + bits_stride], scales[c])


@njit(parallel=True, cache=True)
def unpack_signs(scales, bits, chunk_size, bits_stride, out):
    """Fill the flat float32 ``out`` with +scale / -scale from the sign bits."""
    nchunks = scales.shape[0]
    for c in prange(nchunks):
        start = c * chunk_size
        os = out[start:min(start + chunk_size, out.size)]
        bs = bits[c * bits_stride:(c + 1) * bits_stride]
        scale = scales[c]
        for k in range(os.size):
            negative = (bs[k >> 3] >> (k & 7)) & 1
            os[k] = -scale if negative else scale
