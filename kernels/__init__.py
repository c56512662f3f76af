"""Gradient compression kernels for commlib: min-max uint8, min-max int4 and 1-bit sign.

Installed as ``commlib.kernels`` (``from commlib import kernels``), from the ``kernels/``
folder of the source tree (setup.py's package_dir); there is no top-level
``kernels``, the name of Hugging Face's package.

Each compressor produces ONE contiguous uint8 buffer that describes itself (see
``commlib.kernels._layout`` for the byte layout), so a piece can travel alone through an MPI
alltoall or allgather and be decompressed by the receiver with no side information.
Buffers of the same kind, element count and chunk size always have the same length.

.. not run: a summary of the signatures, not code

API (``Array`` is a numpy array, a torch tensor on CPU or CUDA, or a cupy array)::

    quantize_minmax_uint8(x: Array, chunk_size: int = 2048, *, out=None, impl=None,
                          nonfinite="raise") -> Array[uint8]
    dequantize_minmax_uint8(buf: Array, out: Array | None = None, *, impl=None) -> Array[f32]
    compress_sign(x: Array, residual: Array, chunk_size: int = 2048, *, out=None, impl=None,
                  nonfinite="raise", residual_out=None) -> Array[uint8]
                                          # updates residual in place, or into residual_out
    decompress_sign(buf: Array, out: Array | None = None, *, impl=None) -> Array[f32]
    quantize_minmax_int4(x: Array, chunk_size: int = 2048, *, out=None, impl=None,
                         nonfinite="raise") -> Array[uint8]     # chunk_size even
    dequantize_minmax_int4(buf: Array, out: Array | None = None, *, impl=None) -> Array[f32]
    header_bytes(numel, chunk_size=2048, kind="minmax_int4") -> numpy uint8 (32,)
    decompress(buf: Array, out=None, *, impl=None) -> Array[f32]   # either kind
    compressed_nbytes(numel: int, chunk_size: int = 2048, kind: str = "minmax_uint8") -> int
    read_header(buf: Array) -> Layout     # kind, numel, chunk_size, nchunks, nbytes
    all_chunks_finite(buf: Array) -> bool # False if some chunk is a NaN chunk

For example, a round trip through min-max uint8 (the error is at most half a step of
each chunk's 255 levels)::

    import numpy as np
    from commlib import kernels

    x = np.linspace(-1, 1, 5000, dtype=np.float32)
    buf = kernels.quantize_minmax_uint8(x)
    assert buf.dtype == np.uint8 and buf.size == kernels.compressed_nbytes(x.size)
    assert np.abs(kernels.dequantize_minmax_uint8(buf) - x).max() <= 1 / 255

Inputs of any shape are read flattened, as float32 (float16, float64 and torch bfloat16
are converted first; float64 values beyond the float32 range become Inf and are
rejected). Outputs are of the input's kind and on its device: numpy in, numpy out;
torch in, torch out on the same device; cupy in, cupy out. Every function returns a new
1-D array, or fills ``out`` in place and returns it: for compressors a C-contiguous uint8
array of exactly ``compressed_nbytes(...)`` elements (say, one slot of an alltoall send
buffer), for decompressors a C-contiguous float32 array of ``numel`` elements, any
shape; always of the input's kind and device.

``impl`` forces the implementation: ``"cpu"`` (Numba, parallel over chunks) or
``"cuda"`` (Numba CUDA kernels; ``NUMBA_ENABLE_CUDASIM=1`` runs them on the simulator).
The default runs where the data lives. Host data with ``impl="cuda"`` and GPU data with
``impl="cpu"`` are copied over and the result copied back. ``numba.cuda`` and ``cupy``
are imported only when the CUDA path runs; if it is requested and unusable, the error
says to ``pip install 'commlib[cuda]'``.

Min-max uint8 (per chunk of ``chunk_size`` elements, the last one may be shorter): stores
the chunk's min and max as float32 and one code per element,
``q = rint((x - min) * (255 / (max - min)))``, decoded as
``x' = min(min + (q * (1 / 255)) * (max - min), max)`` (float32 throughout; the exact
sequence of operations is in ``commlib.kernels._arith``). Constant chunks are exact. The error
per element is at most ``(max - min) / 510`` plus float32 rounding.

Min-max int4: as min-max uint8 with 15 levels, two codes per byte (low nibble first),
every chunk stored whole (the last one padded with its last element's code); decoded as
``min(min + code * ((max - min) / 15), max)``. Its two sections (parameters, codes) are
byte for byte the wire format of ``commlib.algorithms.int4`` (tested against it).

1-bit sign with error feedback: compresses ``v = x + residual``; stores per chunk the
scale ``mean |v|`` (float32) and one bit per element (1 = negative; +0.0 and -0.0 count
as positive). Decoding gives ``+scale`` or ``-scale``; the caller-owned ``residual`` is
updated in place to ``v - decoded``, so what is not sent now is sent later.

Non-finite input: NaN or Inf anywhere in ``x`` (for sign: in ``x + residual``) raises
``ValueError`` naming the first bad chunk and its element range; nothing is returned
and, for the sign compressor, ``residual`` is left unchanged. A chunk whose
``max - min`` overflows float32 (values of opposite sign near 3.4e38) is rejected the
same way. Decompression trusts the buffer's contents after validating its header.
With ``nonfinite="nan"`` the compressors raise nothing: such a chunk is encoded as a NaN
chunk (its min and max, or its scale, are NaN and its data bytes zero), which
decompresses to NaN; the sign compressor leaves that chunk's residual unchanged. This is
how the compressed allreduce carries "some rank's input was not finite" to every rank at
no cost. ``all_chunks_finite(buf)`` reads only the per-chunk parameters.

The CPU kernels run on Numba's thread pool (``NUMBA_NUM_THREADS``); inputs under 64 Ki
elements run on the calling thread. With several MPI ranks on one node, give each rank
its share of the cores: an oversubscribed pool (the OpenMP layer in particular) was
measured 10-100x slower.

Exact float32 arithmetic (``commlib.kernels._arith``) is shared by the CPU twin and the CUDA
kernel; under the CUDA simulator both give byte-identical buffers. On a GPU the
compressed bytes should match too (no step is a multiply followed by an add, which the
GPU compiler could fuse), and are tested to agree within one quantization level;
dequantized values may differ in the last bits where the GPU fuses ``lo + a * rng``.
"""
from __future__ import annotations

from . import _threads

_threads.configure()  # before anything imports Numba

from ._api import (
    DEFAULT_CHUNK_SIZE,
    NONFINITE_MODES,
    Array,
    all_chunks_finite,
    compress_sign,
    compressed_nbytes,
    decompress_sign,
    dequantize_minmax_uint8,
    quantize_minmax_uint8,
    read_header,
)
from ._int4 import dequantize_minmax_int4, header_bytes, quantize_minmax_int4
from ._layout import MINMAX_INT4, MINMAX_UINT8, SIGN1, Layout


def decompress(buf: Array, out: Array | None = None, *, impl: str | None = None) -> Array:
    """Decompress any buffer from this package, dispatching on the kind in its header
    (defined here: ``_int4`` builds on ``_api``, which therefore does not import it)."""
    kind = read_header(buf).kind
    if kind == MINMAX_UINT8:
        return dequantize_minmax_uint8(buf, out, impl=impl)
    if kind == MINMAX_INT4:
        return dequantize_minmax_int4(buf, out, impl=impl)
    return decompress_sign(buf, out, impl=impl)


__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "MINMAX_INT4",
    "MINMAX_UINT8",
    "NONFINITE_MODES",
    "SIGN1",
    "Layout",
    "all_chunks_finite",
    "compress_sign",
    "compressed_nbytes",
    "decompress",
    "decompress_sign",
    "dequantize_minmax_int4",
    "dequantize_minmax_uint8",
    "header_bytes",
    "quantize_minmax_int4",
    "quantize_minmax_uint8",
    "read_header",
]
