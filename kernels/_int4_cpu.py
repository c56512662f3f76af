"""CPU twin of the min-max int4 kernels (Numba, parallel over chunks); the arithmetic is
in ``_arith``, the range pass is the uint8 kernel's (``_minmax_cpu._chunk_range``).

Compiled code is cached beside this file; see ``_minmax_cpu`` for what the cache keys on."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._arith import F0, F1, F15, INF, NON_FINITE, OK, RANGE_OVERFLOW, TINY_PRE, TINY_RANGE
from ._minmax_cpu import _chunk_bounds, _chunk_range

_LOW = np.uint8(0x0F)
_FOUR = np.uint8(4)


@njit(cache=True, inline="always")
def _pack_chunk(xs, ds, lo, rng):
    """Codes of the chunk ``xs`` into its ``ds`` (``chunk_size / 2`` bytes), positions
    past the end coded as the last element."""
    if rng == F0:
        ds[:] = 0
        return
    pre = TINY_PRE if rng < TINY_RANGE else F1
    scale = F15 / (rng * pre)
    last = xs.size - 1
    for j in range(ds.size):
        a = min(2 * j, last)
        b = min(2 * j + 1, last)
        qa = np.uint8(np.rint(((xs[a] - lo) * pre) * scale))
        qb = np.uint8(np.rint(((xs[b] - lo) * pre) * scale))
        ds[j] = np.uint8(qa | np.uint8(qb << _FOUR))


@njit(parallel=True, cache=True)
def quantize(x, chunk_size, params, data, status, ntasks):
    """Fill ``params`` (nchunks, 2) float32, ``data`` (nchunks * chunk_size / 2,) uint8
    and ``status`` (nchunks,) uint8 from the flat float32 ``x``. Chunks with a bad
    status are left unquantized; the caller raises or marks them."""
    nchunks = params.shape[0]
    half = chunk_size // 2
    bits = x.view(np.int32)
    for t in prange(ntasks):
        scratch = np.empty(2, np.int32)
        for c in range(t * nchunks // ntasks, (t + 1) * nchunks // ntasks):
            start, stop = _chunk_bounds(c, chunk_size, x.size)
            lo, hi, finite = _chunk_range(bits[start:stop], scratch)
            params[c, 0] = lo
            params[c, 1] = hi
            rng = hi - lo
            if not finite:
                status[c] = NON_FINITE
            elif not rng < INF:
                status[c] = RANGE_OVERFLOW
            else:
                status[c] = OK
                _pack_chunk(x[start:stop], data[c * half:(c + 1) * half], lo, rng)


@njit(parallel=True, cache=True)
def dequantize(params, data, chunk_size, out):
    """Fill the flat float32 ``out`` (numel,) from ``params`` and ``data``."""
    nchunks = params.shape[0]
    half = chunk_size // 2
    for c in prange(nchunks):
        start, stop = _chunk_bounds(c, chunk_size, out.size)
        ds = data[c * half:(c + 1) * half]
        os = out[start:stop]
        lo = params[c, 0]
        hi = params[c, 1]
        step = (hi - lo) / F15
        for k in range(os.size):
            byte = ds[k // 2]
            code = (byte >> _FOUR) if k % 2 else (byte & _LOW)
            v = lo + np.float32(code) * step
            os[k] = v if v < hi else hi
