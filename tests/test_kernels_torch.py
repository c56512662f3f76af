"""torch tensors (CPU) through the public API: same bytes as numpy, torch results,
in-place residual and ``out=``. CUDA tensors are covered in test_kernels_gpu.py."""
import numpy as np
import pytest

from commlib import kernels

torch = pytest.importorskip("torch")

F32 = np.float32


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_torch_input_gives_numpy_bytes_and_torch_output(dtype):
    t = torch.randn(17, 29, dtype=torch.float32).to(getattr(torch, dtype))
    buf = kernels.quantize_minmax_uint8(t, 100)
    assert isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8
    assert np.array_equal(buf.numpy(), kernels.quantize_minmax_uint8(t.float().numpy(), 100))
    out = kernels.dequantize_minmax_uint8(buf)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    expected = kernels.dequantize_minmax_uint8(buf.numpy())
    assert np.array_equal(out.numpy(), expected)


def test_torch_tensor_requiring_grad():
    t = torch.randn(100, requires_grad=True)
    buf = kernels.quantize_minmax_uint8(t, 32)
    assert np.array_equal(buf.numpy(), kernels.quantize_minmax_uint8(t.detach().numpy(), 32))


def test_out_tensor_is_filled_in_place():
    buf = torch.from_numpy(kernels.quantize_minmax_uint8(np.linspace(-1, 1, 300, dtype=F32), 64))
    out = torch.empty(3, 100)
    assert kernels.dequantize_minmax_uint8(buf, out=out) is out
    assert np.array_equal(out.numpy().ravel(), kernels.dequantize_minmax_uint8(buf.numpy()))


def test_torch_gives_numpy_bytes_and_updates_residual_in_place():
    x = torch.randn(33, 40)
    residual = torch.randn(33, 40) * 0.1
    np_residual = residual.numpy().copy()
    buf = kernels.compress_sign(x, residual, 128)
    assert isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8
    assert np.array_equal(buf.numpy(), kernels.compress_sign(x.numpy(), np_residual, 128))
    assert np.array_equal(residual.numpy(), np_residual)
    out = kernels.decompress_sign(buf, out=torch.empty(33, 40))
    assert out.shape == (33, 40) and np.array_equal(out.numpy().ravel(),
                                                    kernels.decompress_sign(buf.numpy()))


def test_low_precision_x_is_read_as_float32():
    x = torch.randn(500).to(torch.bfloat16)
    r1, r2 = torch.zeros(500), np.zeros(500, F32)
    assert np.array_equal(kernels.compress_sign(x, r1, 64).numpy(),
                          kernels.compress_sign(x.float().numpy(), r2, 64))
    assert np.array_equal(r1.numpy(), r2)


def test_mixing_numpy_and_torch_is_rejected():
    x = np.ones(100, F32)
    buf = kernels.quantize_minmax_uint8(x, 16)
    with pytest.raises(TypeError, match="out must be a numpy array"):
        kernels.dequantize_minmax_uint8(buf, out=torch.empty(100))
    with pytest.raises(TypeError, match="residual must be a numpy array"):
        kernels.compress_sign(x, torch.zeros(100), 16)


def test_compressors_fill_an_out_tensor():
    x = torch.randn(1000)
    slot = torch.empty(kernels.compressed_nbytes(1000, 128), dtype=torch.uint8)
    assert kernels.quantize_minmax_uint8(x, 128, out=slot) is slot
    assert np.array_equal(slot.numpy(), kernels.quantize_minmax_uint8(x.numpy(), 128))
    slot = torch.empty(kernels.compressed_nbytes(1000, 128, "sign1"), dtype=torch.uint8)
    assert kernels.compress_sign(x, torch.zeros(1000), 128, out=slot) is slot
    assert np.array_equal(slot.numpy(),
                          kernels.compress_sign(x.numpy(), np.zeros(1000, F32), 128))
