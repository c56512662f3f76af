"""CPU twin vs CUDA kernel, byte for byte, on Numba's CUDA simulator.

NUMBA_ENABLE_CUDASIM must be set before Numba is imported, so this module only runs in
a process started with it; ``test_kernels_api.py::test_cuda_simulator_matches_cpu``
starts that process. The simulator runs every GPU thread as a Python thread, so inputs
stay small (a few thousand elements).
"""
import os

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("NUMBA_ENABLE_CUDASIM") != "1",
    reason="needs NUMBA_ENABLE_CUDASIM=1 in the environment; run via "
           "test_kernels_api.py::test_cuda_simulator_matches_cpu")

from commlib import kernels  # noqa: E402

F32 = np.float32


def _inputs():
    rng = np.random.default_rng(2024)
    wide = (rng.standard_normal(2001) * np.exp(rng.uniform(-20, 20, 2001))).astype(F32)
    mixed = rng.standard_normal(1500).astype(F32)
    mixed[:300] = 4.0                       # constant chunks
    mixed[300:310] = [-0.0, 0.0] * 5        # signed zeros deciding min/max
    mixed[400:420] = F32(1e-44)             # subnormals
    tiny = np.concatenate([
        F32(1e-30) * (1 + rng.integers(0, 9, 64) * F32(1.2e-7)),  # range < 2**-64, normal
        rng.integers(-20, 20, 64).astype(F32) * F32(1e-45),       # subnormal steps
    ]).astype(F32)
    return {
        "tiny-ranges": (tiny, 64),
        "empty": (np.zeros(0, F32), 16),
        "single": (np.array([-2.5], F32), 1),
        "ragged": (rng.standard_normal(500).astype(F32), 96),
        "wide-range": (wide, 257),
        "mixed": (mixed, 250),
        "odd-chunks": (rng.standard_normal(200).astype(F32), 13),
        "one-chunk": (rng.uniform(-1, 1, 2048).astype(F32), 2048),
    }


CASES = _inputs()


def _bits(a):
    return a.view(np.uint32) if a.dtype == F32 else a


@pytest.mark.parametrize("name", sorted(CASES))
def test_minmax_quantize_is_byte_identical(name):
    x, chunk = CASES[name]
    cpu = kernels.quantize_minmax_uint8(x, chunk, impl="cpu")
    gpu = kernels.quantize_minmax_uint8(x, chunk, impl="cuda")
    assert np.array_equal(cpu, gpu)
    assert np.array_equal(_bits(kernels.dequantize_minmax_uint8(cpu, impl="cpu")),
                          _bits(kernels.dequantize_minmax_uint8(cpu, impl="cuda")))


@pytest.mark.parametrize("name", sorted(CASES))
def test_sign_compress_is_byte_identical(name):
    x, chunk = CASES[name]
    residual = (np.random.default_rng(5).standard_normal(x.size) * 0.3).astype(F32)
    r_cpu, r_gpu = residual.copy(), residual.copy()
    cpu = kernels.compress_sign(x, r_cpu, chunk, impl="cpu")
    gpu = kernels.compress_sign(x, r_gpu, chunk, impl="cuda")
    assert np.array_equal(cpu, gpu)
    assert np.array_equal(_bits(r_cpu), _bits(r_gpu))
    assert np.array_equal(_bits(kernels.decompress_sign(cpu, impl="cpu")),
                          _bits(kernels.decompress_sign(cpu, impl="cuda")))


def test_out_parameters_on_the_cuda_path():
    x, chunk = CASES["ragged"]
    slot = np.full(kernels.compressed_nbytes(x.size, chunk), 0xAB, np.uint8)
    buf = kernels.quantize_minmax_uint8(x, chunk, out=slot, impl="cuda")
    assert buf is slot
    assert np.array_equal(slot, kernels.quantize_minmax_uint8(x, chunk, impl="cpu"))
    out = np.full(x.size, np.nan, F32)
    assert kernels.dequantize_minmax_uint8(buf, out=out, impl="cuda") is out
    assert np.array_equal(out, kernels.dequantize_minmax_uint8(buf, impl="cpu"))
    slot = np.full(kernels.compressed_nbytes(x.size, chunk, "sign1"), 0xAB, np.uint8)
    kernels.compress_sign(x, np.zeros_like(x), chunk, out=slot, impl="cuda")
    assert np.array_equal(slot, kernels.compress_sign(x, np.zeros_like(x), chunk, impl="cpu"))


@pytest.mark.parametrize("impl", ["cpu", "cuda"])
def test_non_finite_input_raises_the_same_error(impl):
    x = np.linspace(-1, 1, 300, dtype=F32)
    x[250] = np.nan
    with pytest.raises(ValueError, match=r"chunk 4 \(elements 240\.\.299\) contains NaN"):
        kernels.quantize_minmax_uint8(x, 60, impl=impl)
    residual = np.zeros_like(x)
    residual[70] = np.inf
    with pytest.raises(ValueError, match=r"chunk 1 \(elements 60\.\.119\) has a non-finite"):
        kernels.compress_sign(np.ones_like(x), residual, 60, impl=impl)
    assert residual[70] == np.inf and not residual[:70].any() and not residual[71:].any()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # simulator only
def test_nan_chunks_are_byte_identical():
    x = np.linspace(-1, 1, 300, dtype=F32)
    x[70], x[200], x[250], x[251] = np.nan, -np.inf, -3e38, 3e38
    cpu = kernels.quantize_minmax_uint8(x, 60, impl="cpu", nonfinite="nan")
    gpu = kernels.quantize_minmax_uint8(x, 60, impl="cuda", nonfinite="nan")
    assert np.array_equal(cpu, gpu) and not kernels.all_chunks_finite(gpu)
    residual = np.linspace(-0.1, 0.1, 300, dtype=F32)
    r_cpu, r_gpu = residual.copy(), residual.copy()
    cpu = kernels.compress_sign(x[:240], r_cpu[:240], 60, impl="cpu", nonfinite="nan")
    gpu = kernels.compress_sign(x[:240], r_gpu[:240], 60, impl="cuda", nonfinite="nan")
    assert np.array_equal(cpu, gpu)
    assert np.array_equal(_bits(r_cpu), _bits(r_gpu))
    r_in, r_out = residual[:240].copy(), np.zeros(240, F32)
    sep = kernels.compress_sign(x[:240], r_in, 60, impl="cuda", nonfinite="nan",
                                residual_out=r_out)
    assert np.array_equal(sep, cpu) and np.array_equal(r_in, residual[:240])
    assert np.array_equal(_bits(r_out), _bits(r_cpu[:240]))
    for a in (60, 180):  # the NaN chunks kept their residual
        assert np.array_equal(_bits(r_cpu[a:a + 60]), _bits(residual[a:a + 60]))
    assert not np.array_equal(_bits(r_cpu[120:180]), _bits(residual[120:180]))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # simulator only
def test_range_overflow_raises_on_the_cuda_path():
    with pytest.raises(ValueError, match="max - min beyond the float32 range"):
        kernels.quantize_minmax_uint8(np.array([-3e38, 3e38], F32), 2, impl="cuda")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # simulator only
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_int4_quantize_is_byte_identical():
    """Every case (chunk sizes made even), plus NaN chunks: CUDA kernel == CPU twin, and
    the CPU twin == ``commlib.algorithms.int4``'s torch operations (test_kernels_int4)."""
    cases = dict(CASES)
    nan = np.linspace(-1, 1, 300, dtype=F32)
    nan[70], nan[200], nan[250], nan[251] = np.nan, -np.inf, -3e38, 3e38
    cases["nan-chunks"] = (nan, 60)
    for name, (x, chunk) in sorted(cases.items()):
        chunk += chunk % 2
        mode = "nan" if name == "nan-chunks" else "raise"
        cpu = kernels.quantize_minmax_int4(x, chunk, impl="cpu", nonfinite=mode)
        gpu = kernels.quantize_minmax_int4(x, chunk, impl="cuda", nonfinite=mode)
        assert np.array_equal(cpu, gpu), name
        assert np.array_equal(_bits(kernels.dequantize_minmax_int4(cpu, impl="cpu")),
                              _bits(kernels.dequantize_minmax_int4(cpu, impl="cuda"))), name
    with pytest.raises(ValueError, match=r"quantize_minmax_int4: chunk 1 .* contains NaN"):
        kernels.quantize_minmax_int4(nan, 60, impl="cuda")
