"""CUDA kernels for min-max uint8; the arithmetic is spelled out in ``_arith``.

One warp per chunk for quantization: lane ``j`` walks the chunk with stride 32, the
warp folds its 32 partial min/max through shared memory, then the same warp quantizes
the chunk. ``syncthreads`` (not warp shuffles) because the simulator supports only the
former. Dequantization is element-wise, one thread per element.
"""
from __future__ import annotations

import numpy as np

from ._arith import (
    ELEMENT_BLOCK,
    F0,
    F1,
    F255,
    INF,
    INV255,
    LANES,
    NON_FINITE,
    OK,
    RANGE_OVERFLOW,
    TINY_PRE,
    TINY_RANGE,
    WARPS_PER_BLOCK,
)
from ._cuda import load_cuda

cuda = load_cuda()


@cuda.jit
def _quantize_kernel(x, chunk_size, params, q, status):
    lane = cuda.threadIdx.x % LANES
    warp = cuda.threadIdx.x // LANES
    c = cuda.blockIdx.x * WARPS_PER_BLOCK + warp
    lo_s = cuda.shared.array((WARPS_PER_BLOCK, LANES), np.float32)
    hi_s = cuda.shared.array((WARPS_PER_BLOCK, LANES), np.float32)
    z_s = cuda.shared.array((WARPS_PER_BLOCK, LANES), np.float32)
    start = c * chunk_size
    stop = min(start + chunk_size, x.shape[0])
    lo = INF
    hi = -INF
    z = F0
    for i in range(start + lane, stop, LANES):
        v = x[i]
        lo = min(lo, v)
        hi = max(hi, v)
        z += v * F0
    lo_s[warp, lane] = lo
    hi_s[warp, lane] = hi
    z_s[warp, lane] = z
    half = LANES // 2
    while half > 0:
        cuda.syncthreads()
        if lane < half:
            lo_s[warp, lane] = min(lo_s[warp, lane], lo_s[warp, lane + half])
            hi_s[warp, lane] = max(hi_s[warp, lane], hi_s[warp, lane + half])
            z_s[warp, lane] += z_s[warp, lane + half]
        half //= 2
    cuda.syncthreads()
    if c >= params.shape[0]:
        return
    lo = lo_s[warp, 0] + F0
    hi = hi_s[warp, 0] + F0
    rng = hi - lo
    code = OK
    if not z_s[warp, 0] == F0:
        code = NON_FINITE
    elif not rng < INF:
        code = RANGE_OVERFLOW
    if lane == 0:
        params[c, 0] = lo
        params[c, 1] = hi
        status[c] = code
    if code != OK:
        return
    if rng == F0:
        for i in range(start + lane, stop, LANES):
            q[i] = 0
        return
    pre = TINY_PRE if rng < TINY_RANGE else F1
    scale = F255 / (rng * pre)
    for i in range(start + lane, stop, LANES):
        q[i] = round(((x[i] - lo) * pre) * scale)


@cuda.jit
def _dequantize_kernel(params, q, chunk_size, out):
    i = cuda.grid(1)
    if i >= out.shape[0]:
        return
    c = i // chunk_size
    lo = params[c, 0]
    hi = params[c, 1]
    v = lo + (np.float32(q[i]) * INV255) * (hi - lo)
    out[i] = v if v < hi else hi


def quantize(x, chunk_size: int, params, q, status) -> None:
    """Device arrays: ``x`` (numel,) float32 in; ``params`` (nchunks, 2) float32,
    ``q`` (numel,) uint8 and ``status`` (nchunks,) uint8 out."""
    nchunks = params.shape[0]
    if nchunks:
        grid = -(-nchunks // WARPS_PER_BLOCK)
        _quantize_kernel[grid, WARPS_PER_BLOCK * LANES](x, chunk_size, params, q, status)


def dequantize(params, q, chunk_size: int, out) -> None:
    """Device arrays: ``params`` and ``q`` in, ``out`` (numel,) float32 out."""
    if out.shape[0]:
        grid = -(-out.shape[0] // ELEMENT_BLOCK)
        _dequantize_kernel[grid, ELEMENT_BLOCK](params, q, chunk_size, out)
