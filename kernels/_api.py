"""Public entry points: validate arguments, pick CPU or CUDA, adapt arrays, report bad
chunks. The kernels themselves live in ``_minmax_*`` and ``_sign_*``."""
from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numba
import numpy as np

from . import _arrays as A
from . import _cuda_io as D
from . import _minmax_cpu, _sign_cpu
from ._arith import NON_FINITE, RANGE_OVERFLOW
from ._cuda import load_cuda
from ._layout import (
    HEADER_NBYTES,
    MINMAX_INT4,
    MINMAX_UINT8,
    SIGN1,
    Layout,
    make_layout,
    pack_header,
    parse_header,
    sections,
)

#: Elements per chunk unless told otherwise: 8 bytes of min/max per 2048 codes (0.4 %),
#: 4 bytes of scale per 256 bytes of sign bits (1.6 %).
DEFAULT_CHUNK_SIZE = 2048

#: Parallel runs of chunks per CPU thread: slack to even out threads that fall behind.
TASKS_PER_THREAD = 4

#: Below this many elements the CPU kernels run on the calling thread only: waking the
#: thread pool costs more than the work (and far more when cores are oversubscribed).
PARALLEL_MIN_NUMEL = 1 << 16

#: What the compressors do with a chunk they cannot encode (NaN or Inf; for min-max also
#: a range beyond float32): ``"raise"`` ValueError, or ``"nan"``: encode the chunk as a
#: NaN chunk (parameters NaN, data bytes zero) that decompresses to NaN.
NONFINITE_MODES = ("raise", "nan")

Array = Any  # numpy.ndarray | torch.Tensor | cupy.ndarray


def compressed_nbytes(numel: int, chunk_size: int = DEFAULT_CHUNK_SIZE,
                      kind: str = MINMAX_UINT8) -> int:
    """Length in bytes of the compressed buffer of ``numel`` elements (``kind`` is
    ``"minmax_uint8"``, ``"sign1"`` or ``"minmax_int4"``); the same for every input of that size."""
    return make_layout(kind, numel, chunk_size).nbytes


def read_header(buf: Array) -> Layout:
    """Validated layout of the compressed uint8 buffer ``buf`` (any kind or device):
    ``kind``, ``numel``, ``chunk_size``, ``nchunks``, ``nbytes``. ``ValueError`` if
    ``buf`` is not a complete compressed buffer."""
    kind = A.kind_of(buf)
    return parse_header(A.host_uint8(buf, kind, HEADER_NBYTES), A.numel(buf, kind))


def _impl(impl: str | None, gpu: bool, numel: int) -> str:
    if impl is None:
        impl = "cuda" if gpu else "cpu"
    if impl not in ("cpu", "cuda"):
        raise ValueError(f"impl must be 'cpu', 'cuda' or None, got {impl!r}")
    if impl == "cuda":
        load_cuda()  # fail loudly even when an empty input would need no kernel
        if numel == 0:
            return "cpu"  # header only, no kernel to run; the bytes are identical
    return impl


def _cuda_module(name: str) -> ModuleType:
    return importlib.import_module(f"{__package__}._{name}_cuda")


def _ntasks(nchunks: int) -> int:
    return min(nchunks, TASKS_PER_THREAD * numba.get_num_threads())


@contextlib.contextmanager
def _cpu_threads(numel: int) -> Iterator[None]:
    """Limit the CPU kernels to one thread for small inputs (Numba's setting is per
    calling thread, so this does not affect other threads)."""
    if numel >= PARALLEL_MIN_NUMEL:
        yield
        return
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(previous)


def _write_header(buf: np.ndarray, lay: Layout) -> None:
    buf[:HEADER_NBYTES] = pack_header(lay)
    buf[lay.data_offset + lay.data_nbytes:] = 0


def _raise_for_status(status: np.ndarray, lay: Layout, what: str, reasons: dict,
                      consequence: str) -> None:
    if not status.any():
        return
    bad = np.flatnonzero(status)
    c = int(bad[0])
    first, last = c * lay.chunk_size, min((c + 1) * lay.chunk_size, lay.numel) - 1
    raise ValueError(f"{what}: chunk {c} (elements {first}..{last}) "
                     f"{reasons[int(status[c])]}; {bad.size} of {lay.nchunks} chunks "
                     f"are affected; {consequence}")


def _check_mode(nonfinite: str) -> None:
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")


def _chunk_bytes(lay: Layout, c: int) -> tuple[int, int]:
    """Byte range of chunk ``c`` in the data section."""
    start = c * lay.chunk_size
    length = min(lay.chunk_size, lay.numel - start)
    if lay.kind == MINMAX_UINT8:
        return start, start + length
    if lay.kind == MINMAX_INT4:  # whole chunks, padding included
        half = lay.chunk_size // 2
        return c * half, (c + 1) * half
    first = c * lay.bits_stride
    return first, first + -(-length // 8)


def _mark_nan_chunks(params: Any, data: Any, bad: np.ndarray, lay: Layout) -> None:
    """Turn the chunks ``bad`` of a compressed buffer into NaN chunks: parameters NaN,
    data bytes zero. ``params``/``data`` are the buffer's sections, numpy arrays or Numba
    device arrays."""
    if isinstance(params, np.ndarray):
        params[bad] = np.nan
        for c in bad:
            a, b = _chunk_bytes(lay, int(c))
            data[a:b] = 0
        return
    host = params.copy_to_host()
    host[bad] = np.nan
    params.copy_to_device(host)
    for c in bad:
        a, b = _chunk_bytes(lay, int(c))
        if b > a:
            data[a:b].copy_to_device(np.zeros(b - a, np.uint8))


def _residual_slices(residual: Any, bad: np.ndarray, lay: Layout) -> list:
    """(start, stop, saved copy) of the residual of each chunk in ``bad``."""
    saved = []
    for c in bad:
        a = int(c) * lay.chunk_size
        b = min(a + lay.chunk_size, lay.numel)
        part = residual[a:b]
        saved.append((a, b, part.copy() if isinstance(part, np.ndarray)
                      else part.copy_to_host()))
    return saved


def _restore_residual(residual: Any, saved: list) -> None:
    for a, b, values in saved:
        if isinstance(residual, np.ndarray):
            residual[a:b] = values
        else:
            residual[a:b].copy_to_device(values)


def all_chunks_finite(buf: Array) -> bool:
    """Whether no chunk of the compressed buffer ``buf`` (any kind or device) is a NaN
    chunk (see ``nonfinite="nan"``). Reads the header and the per-chunk parameters only
    (8 or 4 bytes per chunk); every chunk with finite parameters decompresses to finite
    values."""
    kind = A.kind_of(buf)
    lay = read_header(buf)
    head = A.host_uint8(buf, kind, lay.data_offset)
    params = head[lay.params_offset:lay.data_offset].view(np.float32)
    return bool(np.isfinite(params).all())


def _host_output(like: Array, kind: str, n: int, dtype: str, out: Array | None):
    """(flat host array of ``dtype`` to fill, call returning the caller-visible result:
    ``out`` itself when given, else a new array of ``like``'s kind and device)."""
    if out is None:
        host = np.empty(n, dtype)
        return host, lambda: A.like_host(host, like, kind)
    view = A.host_inplace(out, kind)
    if view is not None:
        return view, lambda: out
    host = np.empty(n, dtype)

    def copy_back() -> Array:
        A.copy_from_host(out, kind, host)
        return out
    return host, copy_back


def _check_out(out: Array | None, like: Array, dtype: str, n: int) -> None:
    if out is not None:
        A.same_place(like, out, "out")
        A.check_writable(out, A.kind_of(out), "out", dtype, n)


def _open(buf: Array, expected: str, out: Array | None) -> tuple[str, Layout]:
    kind = A.kind_of(buf)
    lay = read_header(buf)
    if lay.kind != expected:
        raise ValueError(f"expected a {expected} buffer, got {lay.kind}")
    _check_out(out, buf, "float32", lay.numel)
    return kind, lay


def _start(x: Array, kind_name: str, chunk_size: int, out: Array | None) -> tuple[str, Layout]:
    """Validate a compressor's input and ``out``; return x's array kind and the layout."""
    kind = A.kind_of(x)
    A.check_float(x, kind, "x")
    lay = make_layout(kind_name, A.numel(x, kind), chunk_size)
    _check_out(out, x, "uint8", lay.nbytes)
    return kind, lay


# ---------------------------------------------------------------- min-max uint8

_MINMAX_REASONS = {
    NON_FINITE: "contains NaN or Inf (float64 values beyond the float32 range count as Inf)",
    RANGE_OVERFLOW: "has max - min beyond the float32 range",
}


def _minmax_status(status: np.ndarray, params: Any, q: Any, lay: Layout,
                   nonfinite: str) -> None:
    if nonfinite == "nan":
        if status.any():
            _mark_nan_chunks(params, q, np.flatnonzero(status), lay)
        return
    _raise_for_status(status, lay, "quantize_minmax_uint8", _MINMAX_REASONS,
                      "nothing was returned")


def _quantize_cpu(x: Array, kind: str, lay: Layout, out: Array | None,
                  nonfinite: str) -> Array:
    buf, finish = _host_output(x, kind, lay.nbytes, "uint8", out)
    _write_header(buf, lay)
    params, q = sections(buf, lay)
    status = np.zeros(lay.nchunks, np.uint8)
    with _cpu_threads(lay.numel):
        if lay.nchunks:
            _minmax_cpu.quantize(A.host_float32(x, kind), lay.chunk_size, params, q,
                                 status, _ntasks(lay.nchunks))
    _minmax_status(status, params, q, lay, nonfinite)
    return finish()


def _quantize_cuda(x: Array, kind: str, lay: Layout, out: Array | None,
                   nonfinite: str) -> Array:
    mod = _cuda_module("minmax")
    with D.on_device(x, kind):
        dev, finish = D.output(x, kind, lay.nbytes, "uint8", out)
        D.write_header(dev, lay)
        params, q = sections(dev, lay)
        d_status = D.status_array(lay.nchunks)
        mod.quantize(D.to_device(x, kind, True), lay.chunk_size, params, q, d_status)
        _minmax_status(d_status.copy_to_host(), params, q, lay, nonfinite)
        return finish()


def quantize_minmax_uint8(x: Array, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
                          out: Array | None = None, impl: str | None = None,
                          nonfinite: str = "raise") -> Array:
    """Chunked min-max uint8 quantization of ``x``.

    ``x``: any shape, float16/float32/float64 (or torch bfloat16); read as flat float32.
    Returns a 1-D uint8 array of ``compressed_nbytes(x.size, chunk_size)`` bytes, of
    ``x``'s kind and device: ``out`` (filled in place; uint8, C-contiguous, exactly that
    many elements, e.g. one slot of an alltoall send buffer) when given, else a new one.
    ``impl``: ``"cpu"``, ``"cuda"`` or None (where ``x`` lives).
    Raises ``ValueError`` if a chunk holds NaN/Inf or spans more than float32 can hold;
    ``out`` then holds garbage. With ``nonfinite="nan"`` such chunks are encoded as NaN
    chunks instead (min = max = NaN, codes 0; they decompress to NaN) and the others as
    usual.
    """
    _check_mode(nonfinite)
    kind, lay = _start(x, MINMAX_UINT8, chunk_size, out)
    if _impl(impl, A.is_gpu(x, kind), lay.numel) == "cpu":
        return _quantize_cpu(x, kind, lay, out, nonfinite)
    return _quantize_cuda(x, kind, lay, out, nonfinite)


def dequantize_minmax_uint8(buf: Array, out: Array | None = None, *,
                            impl: str | None = None) -> Array:
    """Inverse of ``quantize_minmax_uint8``.

    ``buf``: a complete compressed uint8 buffer. Returns float32 of ``buf``'s kind and
    device: ``out`` (filled in place; float32, C-contiguous, ``numel`` elements, any
    shape) when given, else a new 1-D array of ``numel`` elements.
    """
    kind, lay = _open(buf, MINMAX_UINT8, out)
    if _impl(impl, A.is_gpu(buf, kind), lay.numel) == "cpu":
        params, q = sections(A.host_uint8(buf, kind), lay)
        host, finish = _host_output(buf, kind, lay.numel, "float32", out)
        with _cpu_threads(lay.numel):
            _minmax_cpu.dequantize(params, q, lay.chunk_size, host)
        return finish()
    with D.on_device(buf, kind):
        params, q = sections(D.to_device(buf, kind, False), lay)
        dev, finish = D.output(buf, kind, lay.numel, "float32", out)
        _cuda_module("minmax").dequantize(params, q, lay.chunk_size, dev)
        return finish()


# ---------------------------------------------------------------- 1-bit sign

_SIGN_REASONS = {
    NON_FINITE: "has a non-finite mean |x + residual| (NaN or Inf in x or residual, or "
                "magnitudes whose sum overflows float32)",
}


def _sign_bad_chunks(status: np.ndarray, lay: Layout, nonfinite: str) -> np.ndarray:
    """Chunks to encode as NaN chunks (``nonfinite="nan"``); raises for ``"raise"``."""
    if nonfinite == "raise":
        _raise_for_status(status, lay, "compress_sign", _SIGN_REASONS,
                          "residual was left unchanged")
    return np.flatnonzero(status)


def _compress_sign_cpu(x: Array, kind: str, residual: Array, lay: Layout,
                       out: Array | None, nonfinite: str, residual_out: Array | None) -> Array:
    xf = A.host_float32(x, kind)
    r = A.host_inplace(residual, kind)
    r_host = A.host_float32(residual, kind) if r is None else r
    target = residual if residual_out is None else residual_out
    ro = r_host if residual_out is None else A.host_inplace(residual_out, kind)
    ro_host = ro if ro is not None else np.empty(lay.numel, np.float32)
    buf, finish = _host_output(x, kind, lay.nbytes, "uint8", out)
    _write_header(buf, lay)
    scales, bits = sections(buf, lay)
    status = np.zeros(lay.nchunks, np.uint8)
    with _cpu_threads(lay.numel):
        if lay.nchunks:
            _sign_cpu.chunk_scales(xf, r_host, lay.chunk_size, scales, status,
                                   _ntasks(lay.nchunks))
        bad = _sign_bad_chunks(status, lay, nonfinite)
        saved = _residual_slices(r_host, bad, lay) if bad.size else []
        if lay.nchunks:
            _sign_cpu.pack_signs(xf, r_host, ro_host, lay.chunk_size, scales, bits,
                                 lay.bits_stride)
        if bad.size:
            _restore_residual(ro_host, saved)
            _mark_nan_chunks(scales, bits, bad, lay)
    if ro is None or (residual_out is None and r is None):
        A.copy_from_host(target, kind, ro_host)
    return finish()


def _compress_sign_cuda(x: Array, kind: str, residual: Array, lay: Layout,
                        out: Array | None, nonfinite: str, residual_out: Array | None) -> Array:
    mod = _cuda_module("sign")
    with D.on_device(x, kind):
        d_x = D.to_device(x, kind, True)
        d_r, write_back = D.inplace(residual, kind)
        if residual_out is not None:
            d_ro, write_back = D.inplace(residual_out, kind)
        else:
            d_ro = d_r
        dev, finish = D.output(x, kind, lay.nbytes, "uint8", out)
        D.write_header(dev, lay)
        scales, bits = sections(dev, lay)
        d_status = D.status_array(lay.nchunks)
        mod.chunk_scales(d_x, d_r, lay.chunk_size, scales, d_status)
        bad = _sign_bad_chunks(d_status.copy_to_host(), lay, nonfinite)
        saved = _residual_slices(d_r, bad, lay) if bad.size else []
        mod.pack_signs(d_x, d_r, d_ro, lay.chunk_size, scales, bits, lay.bits_stride)
        if bad.size:
            _restore_residual(d_ro, saved)
            _mark_nan_chunks(scales, bits, bad, lay)
        write_back()
        return finish()


def compress_sign(x: Array, residual: Array, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
                  out: Array | None = None, impl: str | None = None,
                  nonfinite: str = "raise", residual_out: Array | None = None) -> Array:
    """1-bit sign compression of ``v = x + residual`` with error feedback.

    ``x``: any shape, float16/float32/float64 (or torch bfloat16); read as flat float32.
    ``residual``: caller-owned float32, C-contiguous, same kind, device and number of
    elements as ``x``, not overlapping ``x``; updated IN PLACE to
    ``v - decompress_sign(result)``. Start it at zeros. Returns a 1-D uint8 array of
    ``compressed_nbytes(x.size, chunk_size, "sign1")`` bytes on ``x``'s device; ``out``
    and ``impl`` as for ``quantize_minmax_uint8``.
    Raises ``ValueError`` (residual untouched) if a chunk's mean ``|v|`` is not finite. With
    ``nonfinite="nan"`` such chunks are encoded as NaN chunks instead (scale NaN, bits 0;
    they decompress to NaN) and keep their residual; the others are compressed as usual.
    ``residual_out`` (same requirements as ``residual``, not overlapping it): receives the
    updated residual instead, ``residual`` is then only read (the caller can keep or drop
    the update without a copy).
    """
    _check_mode(nonfinite)
    kind, lay = _start(x, SIGN1, chunk_size, out)
    A.same_place(x, residual, "residual")
    A.check_writable(residual, kind, "residual", "float32", lay.numel)
    if residual_out is not None:
        A.same_place(x, residual_out, "residual_out")
        A.check_writable(residual_out, kind, "residual_out", "float32", lay.numel)
    if _impl(impl, A.is_gpu(x, kind), lay.numel) == "cpu":
        return _compress_sign_cpu(x, kind, residual, lay, out, nonfinite, residual_out)
    return _compress_sign_cuda(x, kind, residual, lay, out, nonfinite, residual_out)


def decompress_sign(buf: Array, out: Array | None = None, *,
                    impl: str | None = None) -> Array:
    """Inverse of ``compress_sign``: element ``i`` becomes ``+scale`` or ``-scale`` of its
    chunk. Output rules as for ``dequantize_minmax_uint8``."""
    kind, lay = _open(buf, SIGN1, out)
    if _impl(impl, A.is_gpu(buf, kind), lay.numel) == "cpu":
        scales, bits = sections(A.host_uint8(buf, kind), lay)
        host, finish = _host_output(buf, kind, lay.numel, "float32", out)
        with _cpu_threads(lay.numel):
            _sign_cpu.unpack_signs(scales, bits, lay.chunk_size, lay.bits_stride, host)
        return finish()
    with D.on_device(buf, kind):
        scales, bits = sections(D.to_device(buf, kind, False), lay)
        dev, finish = D.output(buf, kind, lay.numel, "float32", out)
        _cuda_module("sign").unpack_signs(scales, bits, lay.chunk_size, lay.bits_stride, dev)
        return finish()
