"""Moving caller arrays to and from Numba device arrays for the CUDA kernels.

GPU arrays (torch CUDA tensors, cupy arrays) are wrapped zero-copy through the CUDA
Array Interface; host arrays are copied to the device and results copied back, so the
output always lives where the input lives. Kernels run on Numba's default stream, which
is ordered with torch's and cupy's default streams.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _arrays as A
from ._cuda import load_cuda
from ._layout import HEADER_NBYTES, Layout, pack_header


def on_device(obj: Any, kind: str) -> contextlib.AbstractContextManager:
    """Make ``obj``'s GPU current (nothing to do for host arrays)."""
    if not A.is_gpu(obj, kind):
        return contextlib.nullcontext()
    return load_cuda().gpus[A.device_index(obj, kind)]


def to_device(obj: Any, kind: str, float32: bool) -> Any:
    """Flat device array of ``obj`` (float32 if asked, else as is, e.g. uint8)."""
    cuda = load_cuda()
    if A.is_gpu(obj, kind):
        return cuda.as_cuda_array(A.gpu_flat(obj, kind, float32))
    host = A.host_float32(obj, kind) if float32 else A.host_uint8(obj, kind)
    return cuda.to_device(host)


def inplace(obj: Any, kind: str) -> tuple[Any, Callable[[], None]]:
    """(device view of the contiguous float32 ``obj``, call to write it back to ``obj``)."""
    cuda = load_cuda()
    if A.is_gpu(obj, kind):
        return cuda.as_cuda_array(A.gpu_flat(obj, kind, False)), lambda: None
    host = A.host_inplace(obj, kind)
    dev = cuda.to_device(host)
    return dev, lambda: dev.copy_to_host(host)


def output(like: Any, kind: str, n: int, dtype: str,
           out: Any | None) -> tuple[Any, Callable[[], Any]]:
    """(device (n,) array of ``dtype`` to write, call returning the caller-visible result:
    ``out`` itself when given, else a new array of ``like``'s kind and device)."""
    cuda = load_cuda()
    gpu = A.is_gpu(like, kind)
    if out is not None and gpu:
        return cuda.as_cuda_array(A.gpu_flat(out, kind, False)), lambda: out
    if out is not None:
        dev = cuda.device_array(n, dtype)

        def copy_back() -> Any:
            dev.copy_to_host(A.host_inplace(out, kind))
            return out
        return dev, copy_back
    if gpu:
        owned = A.gpu_empty(like, kind, n, dtype)
        return cuda.as_cuda_array(owned), lambda: owned
    dev = cuda.device_array(n, dtype)
    return dev, lambda: A.like_host(dev.copy_to_host(), like, kind)


def write_header(dev: Any, lay: Layout) -> None:
    """Header and zero padding of the compressed device buffer ``dev``."""
    dev[:HEADER_NBYTES].copy_to_device(pack_header(lay))
    end = lay.data_offset + lay.data_nbytes
    if end < lay.nbytes:
        dev[end:].copy_to_device(np.zeros(lay.nbytes - end, np.uint8))


def status_array(nchunks: int) -> Any:
    return load_cuda().device_array(nchunks, np.uint8)
