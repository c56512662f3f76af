"""Min-max uint8 quantization on the CPU: exact reference, error bound, round trips,
non-finite input, dtypes and array kinds."""
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from commlib import kernels

F32 = np.float32
EPS = float(np.finfo(F32).eps)


def reference_quantize(x, chunk):
    """The documented formula, written independently of the package with plain numpy."""
    x = np.asarray(x, F32).ravel()
    nchunks = -(-x.size // chunk)
    params = np.zeros((nchunks, 2), F32)
    codes = np.zeros(x.size, np.uint8)
    for c in range(nchunks):
        part = x[c * chunk:(c + 1) * chunk]
        lo, hi = part.min() + F32(0), part.max() + F32(0)
        params[c] = lo, hi
        rng = hi - lo
        if rng != 0:
            pre = F32(2.0**64) if rng < F32(2.0**-64) else F32(1)
            scale = F32(255) / (rng * pre)
            codes[c * chunk:(c + 1) * chunk] = np.rint(((part - lo) * pre) * scale)
    body = params.tobytes() + codes.tobytes()
    nbytes = -(-(32 + len(body)) // 8) * 8
    head = struct.pack("<4sBBHQQQ", b"CLKC", 1, 1, 0, x.size, chunk, nbytes)
    return np.frombuffer((head + body).ljust(nbytes, b"\0"), np.uint8)


def reference_dequantize(x, chunk):
    ref = reference_quantize(x, chunk)
    n = np.asarray(x).size
    nchunks = -(-n // chunk)
    params = ref[32:32 + 8 * nchunks].view(F32).reshape(nchunks, 2)
    codes = ref[32 + 8 * nchunks:32 + 8 * nchunks + n].astype(F32)
    out = np.empty(n, F32)
    for c, (lo, hi) in enumerate(params):
        s = slice(c * chunk, (c + 1) * chunk)
        out[s] = np.minimum(lo + (codes[s] * F32(1 / 255)) * (hi - lo), hi)
    return out


finite32 = st.floats(min_value=-2.0**122, max_value=2.0**122, width=32, allow_nan=False)
few_values = st.sampled_from([F32(v) for v in (-2.5, -0.0, 0.0, 1.0, 3.0, 1e-40)])
arrays = st.one_of(
    hnp.arrays(F32, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=12),
               elements=finite32),
    # few distinct values: constant chunks, ties, signed zeros, subnormals
    hnp.arrays(F32, st.integers(0, 300), elements=few_values),
)
chunks = st.integers(1, 70)


@settings(max_examples=150, deadline=None)
@given(arrays, chunks)
def test_matches_numpy_reference_exactly(x, chunk):
    buf = kernels.quantize_minmax_uint8(x, chunk)
    assert np.array_equal(buf, reference_quantize(x, chunk))
    out = kernels.dequantize_minmax_uint8(buf)
    assert np.array_equal(out.view(np.uint32), reference_dequantize(x, chunk).view(np.uint32))


@pytest.mark.parametrize("chunk", [1000, 2048])
def test_large_input_on_the_thread_pool_matches_reference(chunk):
    x = np.random.default_rng(9).standard_normal(200_003).astype(F32)
    x[5000:9000] = 1.5  # a constant chunk in the middle
    buf = kernels.quantize_minmax_uint8(x, chunk)
    assert np.array_equal(buf, reference_quantize(x, chunk))
    out = kernels.dequantize_minmax_uint8(buf)
    assert np.array_equal(out.view(np.uint32), reference_dequantize(x, chunk).view(np.uint32))


def _assert_within_bound(x, chunk, out):
    x = np.asarray(x, F32).ravel().astype(np.float64)
    for c in range(0, x.size, chunk):
        part, got = x[c:c + chunk], out[c:c + chunk].astype(np.float64)
        lo, hi = part.min(), part.max()
        # a half level, plus a few float32 roundings of the chunk's magnitude, plus the
        # absolute rounding step of subnormals
        bound = (hi - lo) / 510 + 8 * EPS * max(abs(lo), abs(hi), hi - lo) + 2.0**-149
        assert np.abs(got - part).max() <= bound
        assert got.min() >= lo and got.max() <= hi


@settings(max_examples=150, deadline=None)
@given(arrays, chunks)
def test_error_bound_per_element_per_chunk(x, chunk):
    out = kernels.dequantize_minmax_uint8(kernels.quantize_minmax_uint8(x, chunk))
    assert out.dtype == F32 and out.shape == (x.size,)
    if x.size:
        _assert_within_bound(x, chunk, out)


def test_error_bound_is_tight_enough_to_catch_off_by_one_codes():
    x = np.linspace(0, 255, 256 * 7, dtype=F32)
    buf = kernels.quantize_minmax_uint8(x, 256 * 7)
    out = kernels.dequantize_minmax_uint8(buf)
    _assert_within_bound(x, 256 * 7, out)
    buf[32 + 8 + 100] += 1
    with pytest.raises(AssertionError):
        _assert_within_bound(x, 256 * 7, kernels.dequantize_minmax_uint8(buf))


@pytest.mark.parametrize("shape,chunk", [((0,), 4), ((1,), 1), ((1,), 2048), ((7, 13), 10),
                                         ((3, 4, 5), 60), ((1000,), 999), ((4097,), 2048)])
def test_round_trip_shapes(shape, chunk):
    x = np.random.default_rng(7).standard_normal(shape).astype(F32)
    out = kernels.dequantize_minmax_uint8(kernels.quantize_minmax_uint8(x, chunk))
    assert out.shape == (x.size,)
    _assert_within_bound(x, chunk, out)


def test_constant_chunks_are_exact():
    x = np.concatenate([np.full(50, 3.25, F32), np.full(50, -1e-41, F32),
                        np.linspace(-1, 1, 50, dtype=F32), np.full(7, 0.0, F32)])
    out = kernels.dequantize_minmax_uint8(kernels.quantize_minmax_uint8(x, 50))
    assert np.array_equal(out[:100], x[:100]) and np.array_equal(out[150:], x[150:])


def test_extreme_codes_hit_min_and_max_exactly():
    x = np.array([-7.0, 1.0, 2.0, 3.5], F32)
    buf = kernels.quantize_minmax_uint8(x, 4)
    assert list(buf[40:44]) == [0, 194, 219, 255]  # 8 / 10.5 * 255 = 194.3, 9 / 10.5 * 255 = 218.6
    out = kernels.dequantize_minmax_uint8(buf)
    assert out[0] == -7.0 and out[3] == 3.5


def test_tiny_subnormal_range_is_quantized_not_overflowed():
    x = np.array([0.0, 1e-45, 2e-45, 3e-45], F32)  # 255 / range overflows float32
    out = kernels.dequantize_minmax_uint8(kernels.quantize_minmax_uint8(x, 4))
    assert np.all(np.isfinite(out))
    assert np.array_equal(out, x)


def test_tiny_normal_range_uses_the_scaled_path_exactly():
    # range ~1e-37 < 2**-64: 255 / range would overflow without the power-of-two scaling
    x = (F32(1e-30) * (1 + np.arange(64) % 9 * F32(1.2e-7))).astype(F32)
    buf = kernels.quantize_minmax_uint8(x, 64)
    assert np.array_equal(buf, reference_quantize(x, 64))
    assert len(np.unique(buf[40:])) == len(np.unique(x))
    _assert_within_bound(x, 64, kernels.dequantize_minmax_uint8(buf))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 25, 39])
def test_non_finite_input_raises_naming_the_chunk(bad, where):
    x = np.arange(40, dtype=F32)
    x[where] = bad
    c = where // 10
    with pytest.raises(ValueError, match=rf"chunk {c} \(elements {10 * c}\.\.{10 * c + 9}\) "
                                         r"contains NaN or Inf"):
        kernels.quantize_minmax_uint8(x, 10)


def test_float64_beyond_float32_range_raises():
    with pytest.raises(ValueError, match="chunk 0 .*NaN or Inf"):
        kernels.quantize_minmax_uint8(np.array([1.0, 1e300]), 8)


def test_range_overflow_raises():
    x = np.array([-3e38, 3e38], F32)
    with pytest.raises(ValueError, match="max - min beyond the float32 range"):
        kernels.quantize_minmax_uint8(x, 2)
    # the same values in separate chunks are fine
    assert np.array_equal(
        kernels.dequantize_minmax_uint8(kernels.quantize_minmax_uint8(x, 1)), x)


def test_signed_zero_min_is_stored_as_plus_zero():
    for x in (np.array([-0.0, 0.0, 1.0], F32), np.array([0.0, -0.0, 1.0], F32)):
        buf = kernels.quantize_minmax_uint8(x, 3)
        assert buf[32:36].tobytes() == F32(0.0).tobytes()


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_other_numpy_dtypes_are_read_as_float32(dtype):
    x = np.random.default_rng(3).standard_normal(300).astype(dtype)
    assert np.array_equal(kernels.quantize_minmax_uint8(x, 64),
                          kernels.quantize_minmax_uint8(x.astype(F32), 64))


def test_non_contiguous_input():
    x = np.random.default_rng(4).standard_normal((40, 30)).astype(F32)
    assert np.array_equal(kernels.quantize_minmax_uint8(x.T, 64),
                          kernels.quantize_minmax_uint8(np.ascontiguousarray(x.T), 64))


def test_out_parameter_is_filled_in_place():
    x = np.random.default_rng(5).standard_normal((6, 50)).astype(F32)
    buf = kernels.quantize_minmax_uint8(x, 64)
    out = np.full((6, 50), np.nan, F32)
    assert kernels.dequantize_minmax_uint8(buf, out=out) is out
    assert np.array_equal(out.ravel(), kernels.dequantize_minmax_uint8(buf))


@pytest.mark.parametrize("out,error,message", [
    (np.empty(299, F32), ValueError, "out has 299 elements"),
    (np.empty(300, np.float64), TypeError, "out must be float32"),
    (np.empty((300, 2), F32)[:, 0], ValueError, "C-contiguous"),
])
def test_bad_out_is_rejected(out, error, message):
    buf = kernels.quantize_minmax_uint8(np.ones(300, F32), 64)
    with pytest.raises(error, match=message):
        kernels.dequantize_minmax_uint8(buf, out=out)


@pytest.mark.parametrize("x", [np.arange(10), np.ones(3, bool), [1.0, 2.0]])
def test_non_float_input_is_rejected(x):
    with pytest.raises(TypeError):
        kernels.quantize_minmax_uint8(x, 4)
