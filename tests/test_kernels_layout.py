"""Wire layout of compressed buffers: header fields, sizes, alignment, validation."""
import struct

import numpy as np
import pytest

from commlib import kernels

HEADER = struct.Struct("<4sBBHQQQ")


def _header(buf):
    return HEADER.unpack(bytes(buf[:32]))


@pytest.mark.parametrize("numel,chunk", [(0, 8), (1, 1), (1000, 64), (1001, 64), (5, 1000)])
def test_minmax_header_fields_and_sections(numel, chunk):
    x = np.linspace(-1, 1, numel, dtype=np.float32)
    buf = kernels.quantize_minmax_uint8(x, chunk)
    nchunks = -(-numel // chunk)
    expected = -(-(32 + 8 * nchunks + numel) // 8) * 8
    assert buf.dtype == np.uint8 and buf.shape == (expected,)
    assert _header(buf) == (b"CLKC", 1, 1, 0, numel, chunk, expected)
    params = buf[32:32 + 8 * nchunks].view(np.float32).reshape(nchunks, 2)
    for c in range(nchunks):
        part = x[c * chunk:(c + 1) * chunk]
        assert params[c, 0] == part.min() and params[c, 1] == part.max()
    assert not buf[32 + 8 * nchunks + numel:].any()


@pytest.mark.parametrize("numel,chunk", [(0, 8), (1, 1), (17, 8), (20, 12), (100, 7)])
def test_sign_header_fields_and_sections(numel, chunk):
    buf = kernels.compress_sign(np.ones(numel, np.float32), np.zeros(numel, np.float32), chunk)
    nchunks = -(-numel // chunk)
    stride = -(-chunk // 8)
    last = numel - (nchunks - 1) * chunk
    bits = (nchunks - 1) * stride + -(-last // 8) if nchunks else 0
    expected = -(-(32 + 4 * nchunks + bits) // 8) * 8
    assert buf.shape == (expected,)
    assert _header(buf) == (b"CLKC", 1, 2, 0, numel, chunk, expected)
    assert np.all(buf[32:32 + 4 * nchunks].view(np.float32) == 1.0)


@pytest.mark.parametrize("kind", ["minmax_uint8", "sign1"])
def test_length_depends_only_on_numel_and_chunk(kind):
    rng = np.random.default_rng(0)
    lengths = set()
    for scale in (1e-30, 1.0, 1e30):
        x = (rng.standard_normal(999) * scale).astype(np.float32)
        if kind == "minmax_uint8":
            buf = kernels.quantize_minmax_uint8(x, 100)
        else:
            buf = kernels.compress_sign(x, np.zeros_like(x), 100)
        lengths.add(buf.size)
    assert lengths == {kernels.compressed_nbytes(999, 100, kind)}
    assert kernels.compressed_nbytes(999, 100, kind) % 8 == 0


def test_pieces_laid_end_to_end_decode_alone():
    """What an alltoall receiver sees: equal-length pieces, one after another."""
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal(333).astype(np.float32) for _ in range(4)]
    size = kernels.compressed_nbytes(333, 50)
    recv = np.concatenate([kernels.quantize_minmax_uint8(p, 50) for p in parts])
    for i, p in enumerate(parts):
        piece = recv[i * size:(i + 1) * size]
        direct = kernels.dequantize_minmax_uint8(kernels.quantize_minmax_uint8(p, 50))
        assert np.array_equal(kernels.decompress(piece), direct)


def test_compressing_into_slots_of_one_send_buffer():
    rng = np.random.default_rng(2)
    parts = [rng.standard_normal(250).astype(np.float32) for _ in range(3)]
    q_size = kernels.compressed_nbytes(250, 64)
    s_size = kernels.compressed_nbytes(250, 64, "sign1")
    send_q = np.full(3 * q_size, 0xAB, np.uint8)
    send_s = np.full(3 * s_size, 0xAB, np.uint8)
    for i, p in enumerate(parts):
        slot = send_q[i * q_size:(i + 1) * q_size]
        assert kernels.quantize_minmax_uint8(p, 64, out=slot) is slot
        kernels.compress_sign(p, np.zeros_like(p), 64, out=send_s[i * s_size:(i + 1) * s_size])
    for i, p in enumerate(parts):
        assert np.array_equal(send_q[i * q_size:(i + 1) * q_size],
                              kernels.quantize_minmax_uint8(p, 64))
        assert np.array_equal(send_s[i * s_size:(i + 1) * s_size],
                              kernels.compress_sign(p, np.zeros_like(p), 64))


@pytest.mark.parametrize("out,error,message", [
    (np.empty(10, np.uint8), ValueError, "out has 10 elements"),
    (np.empty(kernels.compressed_nbytes(100, 16), np.int8), TypeError, "out must be uint8"),
    (np.empty((kernels.compressed_nbytes(100, 16), 2), np.uint8)[:, 0], ValueError,
     "C-contiguous"),
])
def test_bad_compressor_out_is_rejected(out, error, message):
    with pytest.raises(error, match=message):
        kernels.quantize_minmax_uint8(np.ones(100, np.float32), 16, out=out)


def test_read_header_reports_layout():
    buf = kernels.quantize_minmax_uint8(np.zeros(100, np.float32), 30)
    lay = kernels.read_header(buf)
    assert (lay.kind, lay.numel, lay.chunk_size, lay.nchunks, lay.nbytes) == (
        "minmax_uint8", 100, 30, 4, buf.size)


def _corrupt(buf, offset, fmt, value):
    bad = buf.copy()
    bad[offset:offset + struct.calcsize(fmt)] = np.frombuffer(struct.pack(fmt, value), np.uint8)
    return bad


@pytest.mark.parametrize("mutate,message", [
    (lambda b: _corrupt(b, 0, "<4s", b"XXXX"), "not a commlib compressed buffer"),
    (lambda b: _corrupt(b, 4, "<B", 2), "version 2 is not supported"),
    (lambda b: _corrupt(b, 5, "<B", 9), "unknown kind code 9"),
    (lambda b: _corrupt(b, 8, "<Q", 200), "length mismatch"),
    (lambda b: _corrupt(b, 16, "<Q", 0), "chunk_size must be in"),
    (lambda b: b[:-8], "length mismatch"),
    (lambda b: b[:20], "too short"),
])
def test_bad_buffers_are_rejected(mutate, message):
    buf = kernels.quantize_minmax_uint8(np.arange(100, dtype=np.float32), 30)
    with pytest.raises(ValueError, match=message):
        kernels.dequantize_minmax_uint8(mutate(buf))


def test_kind_mismatch_is_rejected():
    sign = kernels.compress_sign(np.ones(10, np.float32), np.zeros(10, np.float32), 4)
    with pytest.raises(ValueError, match="expected a minmax_uint8 buffer, got sign1"):
        kernels.dequantize_minmax_uint8(sign)
    minmax = kernels.quantize_minmax_uint8(np.ones(10, np.float32), 4)
    with pytest.raises(ValueError, match="expected a sign1 buffer"):
        kernels.decompress_sign(minmax)


def test_non_uint8_buffer_is_rejected():
    with pytest.raises(TypeError, match="must be uint8"):
        kernels.decompress(np.zeros(64, np.int8))


@pytest.mark.parametrize("chunk,error", [(0, ValueError), (2**24 + 1, ValueError),
                                          (2.5, TypeError), (True, TypeError)])
def test_chunk_size_is_validated(chunk, error):
    with pytest.raises(error, match="chunk_size"):
        kernels.quantize_minmax_uint8(np.ones(4, np.float32), chunk)
    with pytest.raises(error, match="chunk_size"):
        kernels.compressed_nbytes(4, chunk)
