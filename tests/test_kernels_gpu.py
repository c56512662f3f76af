"""CPU twin vs CUDA kernel on a real GPU, and GPU array kinds (torch CUDA, cupy).

Skipped without a usable CUDA GPU. On hardware the compiler may contract a multiply and
an add into an FMA, so codes may differ by one quantization level; min/max, scales and
sign bits involve no multiply-add and must match exactly.
"""
import os

import numpy as np
import pytest


def _real_gpu():
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        from numba import cuda
        return cuda.is_available()
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _real_gpu(), reason="needs a CUDA GPU and numba-cuda")

from commlib import kernels  # noqa: E402

F32 = np.float32


def _data(n, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * np.exp(rng.uniform(-5, 5, n))).astype(F32)


@pytest.mark.parametrize("n,chunk", [(1, 1), (1000, 96), (1 << 20, 2048), (123457, 1000)])
def test_minmax_within_one_level(n, chunk):
    x = _data(n, n)
    cpu = kernels.quantize_minmax_uint8(x, chunk, impl="cpu")
    gpu = kernels.quantize_minmax_uint8(x, chunk, impl="cuda")
    lay = kernels.read_header(cpu)
    start = 32 + 8 * lay.nchunks
    assert np.array_equal(cpu[:start], gpu[:start])  # header, min, max
    diff = np.abs(cpu[start:].astype(np.int16) - gpu[start:].astype(np.int16))
    assert diff.max(initial=0) <= 1
    a = kernels.dequantize_minmax_uint8(cpu, impl="cpu")
    b = kernels.dequantize_minmax_uint8(cpu, impl="cuda")
    # a fused multiply-add rounds once instead of twice: a few ulps of the chunk's scale
    params = cpu[32:start].view(F32).reshape(-1, 2)
    magnitude = np.repeat(np.abs(params).max(axis=1), chunk)[:n]
    assert np.all(np.abs(a - b) <= 4 * np.finfo(F32).eps * magnitude)


@pytest.mark.parametrize("n,chunk", [(1, 1), (1000, 96), (1 << 20, 2048), (123457, 1000)])
def test_sign_matches(n, chunk):
    x = _data(n, n + 1)
    residual = _data(n, n + 2) * F32(0.1)
    r_cpu, r_gpu = residual.copy(), residual.copy()
    cpu = kernels.compress_sign(x, r_cpu, chunk, impl="cpu")
    gpu = kernels.compress_sign(x, r_gpu, chunk, impl="cuda")
    assert np.array_equal(cpu, gpu)
    assert np.array_equal(r_cpu, r_gpu)
    assert np.array_equal(kernels.decompress_sign(cpu, impl="cpu"),
                          kernels.decompress_sign(cpu, impl="cuda"))


def test_torch_cuda_tensors_stay_on_the_device():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    x = torch.randn(3000, 7, device="cuda")
    buf = kernels.quantize_minmax_uint8(x, 512)
    assert buf.device == x.device and buf.dtype == torch.uint8
    host = kernels.quantize_minmax_uint8(x.cpu().numpy(), 512)
    assert np.abs(buf.cpu().numpy().astype(int) - host.astype(int)).max() <= 1
    out = torch.empty(3000, 7, device="cuda")
    assert kernels.dequantize_minmax_uint8(buf, out=out) is out
    residual = torch.zeros(3000, 7, device="cuda")
    r_host = np.zeros(21000, F32)
    sbuf = kernels.compress_sign(x.to(torch.bfloat16), residual, 512)
    assert sbuf.device == x.device
    expected = kernels.compress_sign(x.to(torch.bfloat16).float().cpu().numpy(), r_host, 512)
    assert np.array_equal(sbuf.cpu().numpy(), expected)
    assert np.array_equal(residual.cpu().numpy().ravel(), r_host)
    decoded = kernels.decompress_sign(sbuf)
    assert decoded.device == x.device and decoded.dtype == torch.float32
    # the CPU implementation on device data copies over and back
    assert kernels.quantize_minmax_uint8(x, 512, impl="cpu").device == x.device


def test_cupy_arrays_stay_on_the_device():
    cp = pytest.importorskip("cupy")
    x = cp.asarray(_data(5000, 3))
    buf = kernels.quantize_minmax_uint8(x, 256)
    assert isinstance(buf, cp.ndarray) and buf.dtype == cp.uint8
    out = kernels.dequantize_minmax_uint8(buf)
    assert isinstance(out, cp.ndarray) and out.dtype == cp.float32
    host = kernels.dequantize_minmax_uint8(cp.asnumpy(buf))
    assert np.allclose(cp.asnumpy(out), host, rtol=1e-6, atol=1e-30)
    residual = cp.zeros(5000, cp.float32)
    sbuf = kernels.compress_sign(x, residual, 256)
    assert isinstance(sbuf, cp.ndarray) and bool(residual.any())


def _special_cases():
    """The simulator tests' inputs (constant chunks, signed zeros, subnormals, tiny and
    huge ranges, empty, ragged last chunks) and NaN/Inf chunks, for the real GPU."""
    from test_kernels_cudasim import CASES
    cases = dict(CASES)
    x = np.random.default_rng(9).standard_normal(310).astype(F32)
    x[70], x[200], x[250], x[251] = np.nan, -np.inf, -3e38, 3e38
    cases["nan-inf-chunks"] = (x, 60)
    return cases


SPECIAL = _special_cases()


@pytest.mark.parametrize("name", sorted(SPECIAL))
def test_special_inputs_match_the_cpu_twin(name):
    x, chunk = SPECIAL[name]
    cpu = kernels.quantize_minmax_uint8(x, chunk, impl="cpu", nonfinite="nan")
    gpu = kernels.quantize_minmax_uint8(x, chunk, impl="cuda", nonfinite="nan")
    start = 32 + 8 * kernels.read_header(cpu).nchunks
    assert np.array_equal(cpu[:start], gpu[:start])  # header, min, max (NaN chunks too)
    diff = np.abs(cpu[start:].astype(np.int16) - gpu[start:].astype(np.int16))
    assert diff.max(initial=0) <= 1  # an FMA may move a code by one level
    residual = (np.random.default_rng(5).standard_normal(x.size) * 0.3).astype(F32)
    r_cpu, r_gpu = residual.copy(), residual.copy()
    s_cpu = kernels.compress_sign(x, r_cpu, chunk, impl="cpu", nonfinite="nan")
    s_gpu = kernels.compress_sign(x, r_gpu, chunk, impl="cuda", nonfinite="nan")
    assert np.array_equal(s_cpu, s_gpu)
    assert np.array_equal(r_cpu.view(np.uint32), r_gpu.view(np.uint32))
    assert np.array_equal(kernels.decompress_sign(s_cpu, impl="cpu").view(np.uint32),
                          kernels.decompress_sign(s_cpu, impl="cuda").view(np.uint32))
