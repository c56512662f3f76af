"""The float32 arithmetic shared by the CPU twins and the CUDA kernels.

Both implementations must produce the same bytes, so every constant they use is a
``np.float32`` here: in Numba a bare Python ``255`` or ``0.5`` next to a float32 promotes
the expression to float64, which would silently change the rounding on one side only.

Min-max uint8, per chunk ``c`` holding ``x[s:e]`` (all float32, round-to-nearest-even):

    lo    = min(x[s:e]) + 0.0      # + 0.0 turns -0.0 into +0.0: min/max of {-0, +0}
    hi    = max(x[s:e]) + 0.0      # depends on visiting order, the stored bytes must not
    rng   = hi - lo                # must be finite, otherwise ValueError
    pre   = 2**64 if rng < 2**-64 else 1
    scale = 255 / (rng * pre)
    q[i]  = 0                                       if rng == 0  (constant chunk: exact)
    q[i]  = rint(((x[i] - lo) * pre) * scale)       otherwise

``rint`` rounds half to even. One division per chunk and two multiplications per element
(a division per element costs a third of the CPU throughput). ``pre`` is a power of two,
so multiplying by it is exact; it keeps ``scale`` finite for tiny ranges, where
``255 / rng`` would overflow to inf, and is 1 otherwise. ``x[i] - lo <= rng`` holds after
rounding (rounding is monotone), so the product is at most ``255 * (1 + 2**-23)`` and
``q`` lies in [0, 255] without clamping. The chain is subtract, multiply, multiply: no
multiply-add pair that a GPU compiler could contract into an FMA. Dequantization:

    x'[i] = min(lo + (float32(q[i]) * float32(1 / 255)) * rng, hi)

``q / 255`` first (rather than a per-chunk step ``rng / 255``) because that step
underflows for subnormal ranges, and ``(q / 255) * rng <= rng`` cannot overflow. The
final ``min`` keeps ``x'`` inside ``[lo, hi]`` where the products round up. Here a GPU
may fuse the multiply and the add, so dequantized values agree to within rounding.

Min-max int4 (``commlib.kernels._int4``), per chunk as above but with 15 levels and a per-chunk
step for decoding (the arithmetic of ``commlib.algorithms.int4``, bit for bit):

    scale = 15 / (rng * pre)                         (0 codes if rng == 0)
    q[i]  = rint(((x[i] - lo) * pre) * scale)        in [0, 15] by the same argument
    step  = rng / 15
    x'[i] = min(lo + float32(q[i]) * step, hi)       (a GPU may fuse this multiply-add)

1-bit sign with error feedback, per chunk of ``n`` elements of ``v = x + residual``:

    acc[j]  = sum of |v[s + j + 32 k]| over k = 0, 1, ... in increasing k    (j < 32 lanes)
    acc[j] += acc[j + h]  for h = 16, 8, 4, 2, 1 and j < h                  (fixed tree)
    scale   = acc[0] / float32(n)                                            (mean |v|)
    bit[i]  = 1 if v[i] < 0 else 0          (+0.0 and -0.0 both encode as +)
    x'[i]   = -scale if bit[i] else +scale
    residual[i] = v[i] - x'[i]

The 32-lane order is what a CUDA warp does naturally (lane ``j`` walks the chunk with
stride 32), and on the CPU the 32 lane accumulators are independent, so LLVM vectorizes
them without reassociating any float sum. Nothing here may be compiled with fastmath.
"""
from __future__ import annotations

import numpy as np

F0 = np.float32(0.0)
F1 = np.float32(1.0)
F255 = np.float32(255.0)
INV255 = np.float32(1.0 / 255.0)
F15 = np.float32(15.0)
TINY_RANGE = np.float32(2.0**-64)
TINY_PRE = np.float32(2.0**64)
INF = np.float32(np.inf)

#: Accumulator lanes per chunk for order-dependent reductions (= CUDA warp size).
LANES = 32

#: Chunks per CUDA block in the chunk-wise kernels (one warp per chunk).
WARPS_PER_BLOCK = 4

#: Threads per CUDA block in the element-wise kernels.
ELEMENT_BLOCK = 256

#: float32 represents every integer up to 2**24 exactly; the sign compressor divides by
#: the chunk length as a float32, so chunks may not be longer than this.
MAX_CHUNK_SIZE = 1 << 24

#: Status codes written per chunk by the compressors (0 = fine).
OK = 0
NON_FINITE = 1
RANGE_OVERFLOW = 2
