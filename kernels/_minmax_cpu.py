"""CPU twin of the min-max uint8 kernels (Numba, parallel over chunks).

Performance notes (why the code looks the way it does):

* Every chunk is processed through a slice view indexed from 0. Indexing the whole
  array with ``range(start, stop)`` makes Numba emit negative-index wraparound checks,
  which stops LLVM from vectorizing the loop (measured: 4x slower).
* Without fastmath LLVM will not vectorize a float min/max reduction, so the min/max
  pass keeps ``LANES`` independent accumulators and folds them at the end; min and max
  do not depend on order, so this matches the CUDA kernel bit for bit.
* Scratch arrays are allocated once per task (a run of consecutive chunks), not once
  per chunk: an allocation inside the parallel loop costs as much as a small chunk.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._arith import F0, F255, INF, LANES, NON_FINITE, OK, RANGE_OVERFLOW

@njit(cache=True, inline="always")
def _fold(lo_l, hi_l, z_l, v, j):
    lo_l[j] = v if v < lo_l[j] else lo_l[j]
    hi_l[j] = v if v > hi_l[j] else hi_l[j]
    # v * 0 is 0 for finite v and NaN for NaN/inf; the sum keeps any NaN.
    z_l[j] += v * F0


@njit(cache=True, inline="always")
def _chunk_range(xs, scratch):
    """(lo, hi, finite) of the non-empty float32 slice ``xs``."""
    lo_l, hi_l, z_l = scratch[0], scratch[1], scratch[2]
    lo_l[:] = xs[0]
    hi_l[:] = xs[0]
    z_l[:] = F0
    full = xs.size // LANES * LANES
    for base in range(0, full, LANES):
        for j in range(LANES):
            _fold(lo_l, hi_l, z_l, xs[base + j], j)
    for j in range(xs.size - full):
        _fold(lo_l, hi_l, z_l, xs[full + j], j)
    lo, hi, z = lo_l[0], hi_l[0], z_l[0]
    for j in range(1, LANES):
        lo = min(lo, lo_l[j])
        hi = max(hi, hi_l[j])
        z += z_l[j]
    return lo + F0, hi + F0, z == F0


@njit(cache=True, inline="always")
def _quantize_chunk(xs, qs, lo, rng):
    if rng == F0:
        qs[:] = 0
        return
    for i in range(xs.size):
        qs[i] = np.int32(np.rint(((xs[i] - lo) / rng) * F255))


@njit(cache=True, inline="always")
def _chunk_bounds(c, chunk_size, numel):
    start = c * chunk_size
    return start, min(start + chunk_size, numel)


@njit(parallel=True, cache=True)
def quantize(x, chunk_size, params, q, status, ntasks):
    """Fill ``params`` (nchunks, 2) float32, ``q`` (numel,) uint8 and ``status``
    (nchunks,) uint8 from the flat float32 ``x``, in ``ntasks`` parallel runs of
    consecutive chunks. Chunks with a bad status are left unquantized; the caller must
    raise instead of using the output."""
    nchunks = params.shape[0]
    for t in prange(ntasks):
        scratch = np.empty((3, LANES), np.float32)
        for c in range(t * nchunks // ntasks, (t + 1) * nchunks // ntasks):
            start, stop = _chunk_bounds(c, chunk_size, x.size)
            xs = x[start:stop]
            lo, hi, finite = _chunk_range(xs, scratch)
            params[c, 0] = lo
            params[c, 1] = hi
            rng = hi - lo
            if not finite:
                status[c] = NON_FINITE
            elif not rng < INF:
                status[c] = RANGE_OVERFLOW
            else:
                status[c] = OK
                _quantize_chunk(xs, q[start:stop], lo, rng)


@njit(parallel=True, cache=True)
def dequantize(params, q, chunk_size, out):
    """Fill the flat float32 ``out`` (numel,) from ``params`` and ``q``."""
    nchunks = params.shape[0]
    for c in prange(nchunks):
        start, stop = _chunk_bounds(c, chunk_size, out.size)
        qs = q[start:stop]
        os = out[start:stop]
        lo = params[c, 0]
        hi = params[c, 1]
        rng = hi - lo
        for i in range(qs.size):
            v = lo + (np.float32(qs[i]) / F255) * rng
            os[i] = v if v < hi else hi
