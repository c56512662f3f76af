"""The int4 kernels (``kernels.quantize_minmax_int4``, Numba CPU) against the torch
operations of ``commlib.algorithms.int4``: the same bytes and the same decoded bits on
generated inputs (the CUDA kernel is compared with the CPU twin on the simulator in
test_kernels_cudasim.py)."""
import numpy as np
import pytest
import torch

from commlib import kernels
from commlib.algorithms import int4

F32 = np.float32


def _case(seed):
    r = np.random.default_rng(seed)
    rows, length = int(r.integers(1, 5)), int(r.integers(1, 700))
    chunk = int(r.choice([2, 4, 6, 16, 64, 100, 256, 2048]))
    x = (r.standard_normal((rows, length)) * np.exp(r.uniform(-30, 30))).astype(F32)
    kind = seed % 7
    if kind == 1:
        x[:, :length // 2] = 3.0                                   # constant chunks
    elif kind == 2:
        x[0, r.integers(0, length)] = np.nan
    elif kind == 3:
        x[0, r.integers(0, length)] = -np.inf
    elif kind == 4:
        x[0, 0], x[-1, -1] = -3e38, 3e38                          # range overflow
    elif kind == 5:
        x = (r.integers(-20, 20, (rows, length)) * F32(1e-45)).astype(F32)  # subnormal
    elif kind == 6:
        x[:, ::3] = -0.0                                           # signed zeros
        x[:, 1::3] = 0.0
    return x, chunk, ("normal", "constant", "nan", "-inf", "overflow", "subnormal",
                      "zeros")[kind]


def test_int4_kernels_match_torch_ops_bit_for_bit():
    """140 generated cases: rows and lengths, even chunk sizes 2..2048, NaN, Inf, range
    overflow, constant, subnormal and signed-zero chunks."""
    for seed in range(140):
        x, chunk, what = _case(seed)
        rows, length = x.shape
        xt = torch.from_numpy(x)
        ref = int4.compress(xt, chunk, impl="torch")
        got = int4.compress(xt, chunk, impl="kernels")
        case = f"seed {seed} ({what}, rows={rows}, length={length}, chunk={chunk})"
        assert ref.shape == (rows, int4.nbytes(length, chunk)), case
        assert torch.equal(ref, got), f"compressed bytes differ: {case}"
        for r in range(rows):  # the kernel buffer itself: header, then int4's format
            buf = kernels.quantize_minmax_int4(x[r], chunk, nonfinite="nan")
            assert np.array_equal(buf[32:32 + ref.shape[1]], ref[r].numpy()), case
            assert not buf[32 + ref.shape[1]:].any(), case
        a = int4.decompress(ref, length, chunk, impl="torch").numpy()
        b = int4.decompress(ref, length, chunk, impl="kernels").numpy()
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"decoded: {case}"
        finite = np.isfinite(x).all(axis=1)
        if what in ("normal", "constant", "zeros"):
            chunks = int4._chunked(xt, chunk)
            span = (chunks.amax(2) - chunks.amin(2)).repeat_interleave(chunk, 1)[:, :length]
            err = np.abs(a - x)
            assert (err <= span.numpy() / 30 * (1 + 1e-5) + 1e-38).all(), case
        elif what in ("nan", "-inf"):
            assert np.isnan(a[~np.isfinite(x)]).all() and not finite.all(), case


def test_int4_uses_the_kernels_by_default_on_cpu(monkeypatch):
    """streaming_diloco's quantize="int4" goes through int4.compress/decompress with
    impl=None: on CPU tensors that is the kernels (a call counter on them)."""
    calls = []
    real = kernels.quantize_minmax_int4
    monkeypatch.setattr(kernels, "quantize_minmax_int4",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.linspace(-1, 1, 100).reshape(2, 50)
    assert torch.equal(int4.compress(x, 16), int4.compress(x, 16, impl="torch"))
    assert len(calls) == 2 and int4._use_kernels(x, None)
    y = int4.roundtrip(torch.linspace(-1, 1, 37), 16, 3)
    assert len(calls) == 5 and y.shape == (37,)
    with pytest.raises(ValueError, match="impl must be one of"):
        int4.compress(x, 16, impl="numba")


def test_int4_decompresses_a_single_row_with_a_short_chunk():
    """Regression: one row of int4.nbytes not divisible by 4 (chunk_size 2: 18 bytes for 4
    elements) could not be viewed as float32 headers."""
    x = torch.tensor([[1.0, -2.0, 2.0, 3.0]])
    for impl in ("torch", "kernels"):
        buf = int4.compress(x, 2, impl=impl)
        assert torch.equal(int4.decompress(buf, 4, 2, impl=impl), x), impl


def test_int4_kernel_arguments():
    x = np.linspace(-1, 1, 300, dtype=F32)
    with pytest.raises(ValueError, match="chunk_size must be even for minmax_int4"):
        kernels.quantize_minmax_int4(x, 61)
    x[250] = np.nan
    with pytest.raises(ValueError, match=r"quantize_minmax_int4: chunk 4 \(elements "
                                         r"240\.\.299\) contains NaN"):
        kernels.quantize_minmax_int4(x, 60)
    buf = kernels.quantize_minmax_int4(x, 60, nonfinite="nan")
    assert kernels.read_header(buf).kind == "minmax_int4" and not kernels.all_chunks_finite(buf)
    out = kernels.decompress(buf)
    assert np.isnan(out[240:]).all() and np.isfinite(out[:240]).all()
    assert np.abs(out[:240] - x[:240]).max() <= (2 / 299 * 59) / 30 * 1.001
    assert buf.size == kernels.compressed_nbytes(300, 60, "minmax_int4") == 32 + 5 * 8 + 5 * 30 + 2
    with pytest.raises(ValueError, match="expected a minmax_uint8 buffer, got minmax_int4"):
        kernels.dequantize_minmax_uint8(buf)
