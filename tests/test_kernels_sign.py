"""1-bit sign compression with error feedback on the CPU: exact reference, bit order,
error feedback, non-finite input, array kinds."""
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from commlib import kernels

F32 = np.float32


def reference_compress(x, residual, chunk):
    """The documented formula with plain numpy; returns (buffer, new residual)."""
    v = np.asarray(x, F32).ravel() + np.asarray(residual, F32).ravel()
    nchunks = -(-v.size // chunk)
    scales = np.zeros(nchunks, F32)
    bits, new_residual = b"", np.empty_like(v)
    for c in range(nchunks):
        part = v[c * chunk:(c + 1) * chunk]
        lanes = np.zeros(32, F32)
        for j in range(min(32, part.size)):
            lanes[j] = np.add.accumulate(np.abs(part[j::32]), dtype=F32)[-1]
        for half in (16, 8, 4, 2, 1):
            lanes[:half] = lanes[:half] + lanes[half:2 * half]
        scales[c] = lanes[0] / F32(part.size)
        negative = part < 0
        # a full chunk packs to exactly ceil(chunk / 8) bytes, the per-chunk stride
        bits += np.packbits(negative, bitorder="little").tobytes()
        new_residual[c * chunk:(c + 1) * chunk] = part - np.where(negative, -scales[c],
                                                                  scales[c])
    body = scales.tobytes() + bits
    nbytes = -(-(32 + len(body)) // 8) * 8
    head = struct.pack("<4sBBHQQQ", b"CLKC", 1, 2, 0, v.size, chunk, nbytes)
    return np.frombuffer((head + body).ljust(nbytes, b"\0"), np.uint8), new_residual


finite = st.floats(min_value=-2.0**100, max_value=2.0**100, width=32, allow_nan=False)
values = st.one_of(finite, st.sampled_from([F32(0.0), F32(-0.0), F32(1e-42), F32(-2.0)]))


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 200).flatmap(lambda n: st.tuples(hnp.arrays(F32, n, elements=values),
                                                        hnp.arrays(F32, n, elements=values))),
       st.integers(1, 70))
def test_matches_numpy_reference_exactly(xr, chunk):
    x, residual = xr
    expected_buf, expected_residual = reference_compress(x, residual, chunk)
    buf = kernels.compress_sign(x, residual, chunk)
    assert np.array_equal(buf, expected_buf)
    assert np.array_equal(residual.view(np.uint32), expected_residual.view(np.uint32))


@pytest.mark.parametrize("chunk", [1000, 2048])
def test_large_input_on_the_thread_pool_matches_reference(chunk):
    rng = np.random.default_rng(12)
    x = rng.standard_normal(200_003).astype(F32)
    residual = (rng.standard_normal(x.size) * 0.1).astype(F32)
    v = x + residual
    expected_buf, expected_residual = reference_compress(x, residual, chunk)
    buf = kernels.compress_sign(x, residual, chunk)
    assert np.array_equal(buf, expected_buf)
    assert np.array_equal(residual, expected_residual)
    out = kernels.decompress_sign(buf)
    scales = expected_buf[32:32 + 4 * -(-x.size // chunk)].view(F32)
    assert np.array_equal(np.abs(out), np.repeat(scales, chunk)[:x.size])
    assert np.array_equal(out < 0, v < 0)


def test_bit_order_zero_sign_and_scale():
    x = np.array([-1, 2, -3, 0, -0.0, 5, -6, 7, -8], F32)
    residual = np.zeros_like(x)
    buf = kernels.compress_sign(x, residual, 16)
    scale = F32(32) / F32(9)
    assert buf[32:36].view(F32)[0] == scale
    # element k is bit k % 8 of byte k // 8, LSB first; -0.0 and 0.0 count as positive
    assert list(buf[36:38]) == [0b01000101, 0b00000001]
    out = kernels.decompress_sign(buf)
    assert np.array_equal(out, np.where(x < 0, -scale, scale).astype(F32))
    assert np.array_equal(residual, x - out)


@pytest.mark.parametrize("n,chunk", [(1, 1), (9, 8), (100, 7), (1000, 256), (4099, 2048)])
def test_decompress_inverts_compress(n, chunk):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(F32)
    residual = rng.standard_normal(n).astype(F32) * F32(0.1)
    v = x + residual
    buf = kernels.compress_sign(x, residual, chunk)
    out = kernels.decompress_sign(buf)
    # residual carries what was not sent (up to the rounding of v - out)
    assert np.allclose(out + residual, v, rtol=2e-7, atol=1e-7)
    for c in range(0, n, chunk):
        part = v[c:c + chunk]
        assert np.allclose(np.abs(out[c:c + chunk]), np.abs(part).mean(), rtol=1e-5)
        assert np.array_equal(out[c:c + chunk] < 0, part < 0)


def _feedback_run(steps, reset):
    rng = np.random.default_rng(11)
    n, chunk = 4096, 256
    residual = np.zeros(n, F32)
    sent, received = np.zeros(n), np.zeros(n)
    worst_residual, worst_x = 0.0, 0.0
    for t in range(steps):
        # a biased, drifting gradient: without feedback its small components get lost
        x = (rng.standard_normal(n) * (1 + 0.5 * np.sin(t / 10)) + 0.05).astype(F32)
        if reset:
            residual[:] = 0
        buf = kernels.compress_sign(x, residual, chunk)
        sent += x
        received += kernels.decompress_sign(buf)
        worst_residual = max(worst_residual, float(np.linalg.norm(residual)))
        worst_x = max(worst_x, float(np.linalg.norm(x)))
    return sent, received, residual, worst_residual, worst_x


def test_error_feedback_tracks_the_sum_of_inputs():
    sent, received, residual, worst_residual, worst_x = _feedback_run(300, reset=False)
    # telescoping: what was sent minus what arrived is exactly what is still pending
    assert np.allclose(sent - received, residual, atol=1e-3)
    # for a scaled sign compressor |v - C(v)|^2 <= (1 - 1/d)|v|^2 per chunk, and on
    # gaussian-like data about (1 - 2/pi)|v|^2, so the residual stays O(|x|)
    assert worst_residual < 2.0 * worst_x
    assert np.linalg.norm(sent - received) < worst_x


def test_without_feedback_the_same_run_drifts():
    """The contrast that makes the previous test meaningful: the error grows with the
    number of steps instead of staying below one step's gradient."""
    sent, received, _, _, worst_x = _feedback_run(300, reset=True)
    assert np.linalg.norm(sent - received) > 5 * worst_x


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("in_residual", [False, True])
def test_non_finite_raises_and_leaves_residual_untouched(bad, in_residual):
    x = np.linspace(-1, 1, 64, dtype=F32)
    residual = np.linspace(0.5, -0.5, 64, dtype=F32)
    (residual if in_residual else x)[37] = bad
    before = residual.copy()
    with pytest.raises(ValueError, match=r"chunk 2 \(elements 32\.\.47\) has a non-finite"):
        kernels.compress_sign(x, residual, 16)
    assert np.array_equal(residual, before, equal_nan=True)


def test_overflowing_magnitude_sum_raises():
    x = np.full(8, 3e38, F32)
    with pytest.raises(ValueError, match="non-finite mean"):
        kernels.compress_sign(x, np.zeros_like(x), 8)


@pytest.mark.parametrize("residual,error,message", [
    (np.zeros(99, F32), ValueError, "residual has 99 elements"),
    (np.zeros(100, np.float64), TypeError, "residual must be float32"),
    (np.zeros((100, 2), F32)[:, 1], ValueError, "C-contiguous"),
])
def test_bad_residual_is_rejected(residual, error, message):
    with pytest.raises(error, match=message):
        kernels.compress_sign(np.ones(100, F32), residual, 16)
