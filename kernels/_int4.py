"""Public entry points of the min-max int4 codec (two codes per byte, 15 levels per
chunk); validation, dispatch and bad-chunk handling as for min-max uint8 in ``_api``."""
from __future__ import annotations

import numpy as np

from . import _arrays as A
from . import _cuda_io as D
from . import _int4_cpu
from ._api import (
    _MINMAX_REASONS,
    DEFAULT_CHUNK_SIZE,
    Array,
    _check_mode,
    _cpu_threads,
    _cuda_module,
    _host_output,
    _impl,
    _mark_nan_chunks,
    _ntasks,
    _open,
    _raise_for_status,
    _start,
    _write_header,
)
from ._layout import MINMAX_INT4, Layout, make_layout, pack_header, sections


def header_bytes(numel: int, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 kind: str = MINMAX_INT4) -> np.ndarray:
    """The 32 header bytes (uint8 numpy) of a compressed buffer of ``numel`` elements:
    with them, the headerless sections of another codec's buffer (``commlib.algorithms
    .int4``'s wire format) become a buffer these functions read."""
    return pack_header(make_layout(kind, numel, chunk_size))


def _status(status: np.ndarray, params, data, lay: Layout, nonfinite: str) -> None:
    if nonfinite == "nan":
        if status.any():
            _mark_nan_chunks(params, data, np.flatnonzero(status), lay)
        return
    _raise_for_status(status, lay, "quantize_minmax_int4", _MINMAX_REASONS,
                      "nothing was returned")


def quantize_minmax_int4(x: Array, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
                         out: Array | None = None, impl: str | None = None,
                         nonfinite: str = "raise") -> Array:
    """Chunked min-max int4 quantization of ``x`` (layout ``minmax_int4``, ``chunk_size``
    even): per chunk its min and max as float32 and ``rint((x - min) * 15 / (max - min))``
    per element, two per byte. Inputs, ``out``, ``impl`` and ``nonfinite`` as for
    ``quantize_minmax_uint8``; returns ``compressed_nbytes(numel, chunk_size,
    "minmax_int4")`` uint8 of ``x``'s kind and device. The error per element is at most
    ``(max - min) / 30`` plus float32 rounding."""
    _check_mode(nonfinite)
    kind, lay = _start(x, MINMAX_INT4, chunk_size, out)
    if _impl(impl, A.is_gpu(x, kind), lay.numel) == "cpu":
        buf, finish = _host_output(x, kind, lay.nbytes, "uint8", out)
        _write_header(buf, lay)
        params, data = sections(buf, lay)
        status = np.zeros(lay.nchunks, np.uint8)
        with _cpu_threads(lay.numel):
            if lay.nchunks:
                _int4_cpu.quantize(A.host_float32(x, kind), lay.chunk_size, params, data,
                                   status, _ntasks(lay.nchunks))
        _status(status, params, data, lay, nonfinite)
        return finish()
    with D.on_device(x, kind):
        dev, finish = D.output(x, kind, lay.nbytes, "uint8", out)
        D.write_header(dev, lay)
        params, data = sections(dev, lay)
        d_status = D.status_array(lay.nchunks)
        _cuda_module("int4").quantize(D.to_device(x, kind, True), lay.chunk_size, params,
                                      data, d_status)
        _status(d_status.copy_to_host(), params, data, lay, nonfinite)
        return finish()


def dequantize_minmax_int4(buf: Array, out: Array | None = None, *,
                           impl: str | None = None) -> Array:
    """Inverse of ``quantize_minmax_int4``: ``min(min + code * ((max - min) / 15), max)``
    per element (float32). Output rules as for ``dequantize_minmax_uint8``."""
    kind, lay = _open(buf, MINMAX_INT4, out)
    if _impl(impl, A.is_gpu(buf, kind), lay.numel) == "cpu":
        params, data = sections(A.host_uint8(buf, kind), lay)
        host, finish = _host_output(buf, kind, lay.numel, "float32", out)
        with _cpu_threads(lay.numel):
            _int4_cpu.dequantize(params, data, lay.chunk_size, host)
        return finish()
    with D.on_device(buf, kind):
        params, data = sections(D.to_device(buf, kind, False), lay)
        dev, finish = D.output(buf, kind, lay.numel, "float32", out)
        _cuda_module("int4").dequantize(params, data, lay.chunk_size, dev)
        return finish()
