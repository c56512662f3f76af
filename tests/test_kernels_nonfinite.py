"""``nonfinite="nan"``: chunks the compressors cannot encode travel as NaN chunks.

A chunk with NaN or Inf (for min-max also a range beyond float32) is encoded with NaN
parameters and zero data bytes, decompresses to NaN, and (sign) keeps its residual; every
other chunk is byte-for-byte what the compressor writes for clean input. ``"raise"`` (the
default) is unchanged. The CUDA path is checked against the CPU twin on the simulator
(``test_kernels_cudasim.py``).
"""
import numpy as np
import pytest

from commlib import kernels

F32 = np.float32
CHUNK = 60


def _dirty():
    """300 elements, 5 chunks of 60: chunk 1 holds a NaN, chunk 3 an Inf."""
    x = np.linspace(-1, 1, 300, dtype=F32)
    x[70] = np.nan
    x[200] = -np.inf
    return x


def _clean(x, bad_chunks):
    y = x.copy()
    for c in bad_chunks:
        y[c * CHUNK:(c + 1) * CHUNK] = 0.5
    return y


def _chunk_bytes(buf, c):
    lay = kernels.read_header(buf)
    params = buf[32:lay.nchunks * (8 if lay.kind == "minmax_uint8" else 4) + 32]
    params = params.view(F32).reshape(lay.nchunks, -1)
    return params[c]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_minmax_nan_chunks(kind):
    x = _dirty()
    x[250], x[251] = -3e38, 3e38  # chunk 4: range beyond float32
    arg = x if kind == "numpy" else pytest.importorskip("torch").from_numpy(x)
    buf = kernels.quantize_minmax_uint8(arg, CHUNK, nonfinite="nan")
    buf = np.asarray(buf)
    ref = kernels.quantize_minmax_uint8(_clean(x, [1, 3, 4]), CHUNK)
    out = kernels.dequantize_minmax_uint8(buf)
    for c in range(5):
        a, b = c * CHUNK, (c + 1) * CHUNK
        if c in (1, 3, 4):
            assert np.isnan(out[a:b]).all()
            assert np.isnan(_chunk_bytes(buf, c)).all()
        else:
            assert np.array_equal(_chunk_bytes(buf, c), _chunk_bytes(ref, c))
            assert np.array_equal(out[a:b], kernels.dequantize_minmax_uint8(ref)[a:b])
    codes = buf[32 + 5 * 8:32 + 5 * 8 + 300]
    assert not codes[60:120].any() and not codes[180:300].any()
    assert not kernels.all_chunks_finite(buf) and kernels.all_chunks_finite(ref)


def test_minmax_clean_input_is_unchanged_by_the_mode():
    x = np.random.default_rng(1).standard_normal(1000).astype(F32)
    assert np.array_equal(kernels.quantize_minmax_uint8(x, 64),
                          kernels.quantize_minmax_uint8(x, 64, nonfinite="nan"))


def test_sign_nan_chunks_keep_their_residual():
    x = _dirty()
    r0 = (np.random.default_rng(2).standard_normal(300) * 0.1).astype(F32)
    r0[130] = np.nan  # chunk 2: through the residual
    r_nan = r0.copy()
    buf = kernels.compress_sign(x, r_nan, CHUNK, nonfinite="nan")
    r_ref = r0.copy()
    r_ref[120:180] = 0
    ref = kernels.compress_sign(_clean(x, [1, 3]), r_ref, CHUNK)
    out = kernels.decompress_sign(buf)
    for c in range(5):
        a, b = c * CHUNK, (c + 1) * CHUNK
        if c in (1, 2, 3):
            assert np.isnan(out[a:b]).all()
            assert np.array_equal(r_nan[a:b], r0[a:b], equal_nan=True)  # untouched
        else:
            assert np.array_equal(_chunk_bytes(buf, c), _chunk_bytes(ref, c))
            assert np.array_equal(r_nan[a:b], r_ref[a:b])
    assert not kernels.all_chunks_finite(buf) and kernels.all_chunks_finite(ref)


def test_raise_stays_the_default():
    with pytest.raises(ValueError, match="contains NaN"):
        kernels.quantize_minmax_uint8(_dirty(), CHUNK)
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        kernels.quantize_minmax_uint8(_dirty(), CHUNK, nonfinite="ignore")


@pytest.mark.parametrize("nonfinite", ["raise", "nan"])
def test_sign_residual_out_leaves_the_residual_alone(nonfinite):
    x = np.random.default_rng(3).standard_normal(500).astype(F32)
    if nonfinite == "nan":
        x[130] = np.nan
    r0 = (np.random.default_rng(4).standard_normal(500) * 0.1).astype(F32)
    in_place, separate = r0.copy(), r0.copy()
    out = np.full(500, 7.0, F32)
    a = kernels.compress_sign(x, in_place, CHUNK, nonfinite="nan")
    b = kernels.compress_sign(x, separate, CHUNK, nonfinite="nan", residual_out=out)
    assert np.array_equal(a, b)
    assert np.array_equal(separate, r0)  # only read
    assert np.array_equal(out, in_place)  # what the in-place call left
