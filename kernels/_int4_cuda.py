"""CUDA kernels for min-max int4; the arithmetic is in ``_arith``. The range pass is the
uint8 kernel's (one warp per chunk, folded through shared memory); each lane then packs
byte ``j`` (elements ``2j``, ``2j + 1``) of the chunk for ``j = lane, lane + 32, ...``.
Dequantization is element-wise, one thread per element."""
from __future__ import annotations

import numpy as np

from ._arith import (
    ELEMENT_BLOCK,
    F0,
    F1,
    F15,
    INF,
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
def _quantize_kernel(x, chunk_size, params, data, status):
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
    nbytes = chunk_size // 2
    first = c * nbytes
    if rng == F0:
        for j in range(lane, nbytes, LANES):
            data[first + j] = 0
        return
    pre = TINY_PRE if rng < TINY_RANGE else F1
    scale = F15 / (rng * pre)
    last = stop - 1
    for j in range(lane, nbytes, LANES):
        a = min(start + 2 * j, last)
        b = min(start + 2 * j + 1, last)
        qa = round(((x[a] - lo) * pre) * scale)
        qb = round(((x[b] - lo) * pre) * scale)
        data[first + j] = qa | (qb << 4)


@cuda.jit
def _dequantize_kernel(params, data, chunk_size, out):
    i = cuda.grid(1)
    if i >= out.shape[0]:
        return
    c = i // chunk_size
    k = i - c * chunk_size
    byte = data[c * (chunk_size // 2) + k // 2]
    code = (byte >> 4) if k % 2 else (byte & 15)
    lo = params[c, 0]
    hi = params[c, 1]
    v = lo + np.float32(code) * ((hi - lo) / F15)
    out[i] = v if v < hi else hi


def quantize(x, chunk_size: int, params, data, status) -> None:
    """Device arrays: ``x`` (numel,) float32 in; ``params`` (nchunks, 2) float32,
    ``data`` (nchunks * chunk_size / 2,) uint8 and ``status`` (nchunks,) uint8 out."""
    nchunks = params.shape[0]
    if nchunks:
        grid = -(-nchunks // WARPS_PER_BLOCK)
        _quantize_kernel[grid, WARPS_PER_BLOCK * LANES](x, chunk_size, params, data, status)


def dequantize(params, data, chunk_size: int, out) -> None:
    """Device arrays: ``params`` and ``data`` in, ``out`` (numel,) float32 out."""
    if out.shape[0]:
        grid = -(-out.shape[0] // ELEMENT_BLOCK)
        _dequantize_kernel[grid, ELEMENT_BLOCK](params, data, chunk_size, out)
