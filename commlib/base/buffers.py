"""User buffers (numpy arrays, torch tensors, cupy arrays) prepared for MPI.

Rules, the same for every collective:

* Contiguous host buffers (numpy arrays, CPU torch tensors) are handed to MPI as zero-copy
  numpy views; nothing is copied.
* Non-contiguous buffers are handled, never refused: the collective works on a contiguous
  copy, and in-place collectives copy the result back into the caller's buffer.
* GPU buffers (torch CUDA tensors, cupy arrays) go straight to MPI when the MPI library is
  CUDA-aware, after the buffer's current stream is synchronized. Otherwise they travel
  through host staging buffers that are reused between calls (pinned where the GPU library
  can pin them): device -> host before MPI reads, host -> device after MPI writes.
* Output buffers (allgather, reduce_scatter, alltoall) are new objects of the input's kind,
  dtype and device.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from . import accelerator, host_views
from .dtypes import DType, from_numpy, from_torch, supported
from .errors import where
from .options import options


class Buf:
    """A user buffer ready for MPI: ``msg()`` is the ``[memory, count, datatype]`` triple."""

    __slots__ = ("obj", "kind", "dt", "mem", "count", "shape", "_after", "_staging")

    def __init__(self, obj: Any, kind: str, dt: DType, mem: Any, shape: tuple,
                 count: int | None = None) -> None:
        self.obj = obj
        self.kind = kind
        self.dt = dt
        self.mem = mem
        self.count = math.prod(shape) if count is None else count
        self.shape = shape
        self._after: Callable[[], None] | None = None
        self._staging: Any = None

    @property
    def nbytes(self) -> int:
        return self.count * self.dt.itemsize

    def msg(self) -> list:
        return [self.mem, self.count, self.dt.mpi]

    def finish(self) -> None:
        """After MPI is done: copy results back where needed and return staging memory."""
        after, self._after = self._after, None
        if after is not None:
            after()
        if self._staging is not None:
            _pool.release(self._staging)
            self._staging = None

    def describe(self) -> str:
        return f"{self.kind} {self.dt.name}{list(self.shape)}"


def _bad_type(obj: Any, name: str, op: str, rank: int) -> TypeError:
    return TypeError(f"{where(op, rank)}: argument {name!r} must be a numpy.ndarray, "
                     f"torch.Tensor or cupy.ndarray, got {type(obj).__name__}")


def _bad_dtype(dtype: Any, name: str, op: str, rank: int) -> TypeError:
    return TypeError(f"{where(op, rank)}: argument {name!r} has dtype {dtype}, which MPI cannot "
                     f"carry; supported: {', '.join(supported())}")


def adapt(obj: Any, name: str, op: str, rank: int, *, write: bool = False,
          read: bool = True) -> Buf:
    """Prepare ``obj`` for MPI. ``write``: MPI writes into it (in-place result);
    ``read``: MPI reads its current contents (False for pure receive buffers)."""
    cls = obj.__class__
    if cls is np.ndarray:  # the common cases first: every call comes through here
        dt = _NUMPY_DTYPES.get(obj.dtype)
        if dt is not None:
            flags = obj.flags
            if flags.c_contiguous and (flags.writeable or not write):
                return Buf(obj, "numpy", dt, obj, obj.shape, obj.size)
        return _adapt_numpy(obj, name, op, rank, write)
    if cls is host_views.plain():
        return _adapt_torch(obj, name, op, rank, write, read)
    kind = accelerator.kind_of(obj)
    if kind == "numpy":
        return _adapt_numpy(obj, name, op, rank, write)
    if kind == "torch":
        return _adapt_torch(obj, name, op, rank, write, read)
    if kind == "cupy":
        dt = from_numpy(obj.dtype)
        if dt is None:
            raise _bad_dtype(obj.dtype, name, op, rank)
        return _adapt_device(obj, kind, dt, write, read)
    raise _bad_type(obj, name, op, rank)


def _adapt_numpy(a: np.ndarray, name: str, op: str, rank: int, write: bool) -> Buf:
    dt = _NUMPY_DTYPES.get(a.dtype)
    if dt is None:
        dt = from_numpy(a.dtype)
        if dt is None:
            raise _bad_dtype(a.dtype, name, op, rank)
        _NUMPY_DTYPES[a.dtype] = dt
    flags = a.flags
    if write and not flags.writeable:
        raise ValueError(f"{where(op, rank)}: argument {name!r} is a read-only array, but "
                         f"{op} writes its result into it")
    if flags.c_contiguous:
        return Buf(a, "numpy", dt, a, a.shape, a.size)
    mem = np.ascontiguousarray(a)
    buf = Buf(a, "numpy", dt, mem, a.shape)
    if write:
        buf._after = lambda: np.copyto(a, mem)
    return buf


def _adapt_torch(t: Any, name: str, op: str, rank: int, write: bool, read: bool) -> Buf:
    dtype = t.dtype
    dt = _TORCH_DTYPES.get(dtype)
    if dt is None:
        dt = from_torch(dtype)
        if dt is None:
            raise _bad_dtype(dtype, name, op, rank)
        _TORCH_DTYPES[dtype] = dt
    if not t.requires_grad and t.is_cpu and t.is_contiguous() and not options.force_staging:
        # the common case: a contiguous CPU tensor, viewed without a copy (see host_views)
        mem = host_views.view(t, dtype, dt)
        return Buf(t, "torch", dt, mem, mem.shape, mem.size)
    if t.requires_grad:
        import torch
        if write and torch.is_grad_enabled():
            raise ValueError(f"{where(op, rank)}: argument {name!r} requires grad and {op} "
                             f"modifies it in place; pass tensor.detach() or call it under "
                             f"torch.no_grad()")
        t = t.detach()
    if not t.is_cpu or options.force_staging:
        return _adapt_device(t, "torch", dt, write, read)
    contig = t if t.is_contiguous() else t.contiguous()
    buf = Buf(t, "torch", dt, torch_host_view(contig, dt), tuple(t.shape))
    if write and contig is not t:
        buf._after = lambda: t.copy_(contig)
    return buf


#: numpy / torch dtype -> DType, filled on first use (a dict lookup per call instead of
#: the functools cache of commlib.base.dtypes, which formats the dtype's name)
_NUMPY_DTYPES: dict[Any, DType] = {}
_TORCH_DTYPES: dict[Any, DType] = {}


def torch_host_view(t: Any, dt: DType) -> np.ndarray:
    """Zero-copy numpy view of a contiguous CPU tensor (bfloat16 as uint16 words)."""
    if dt.name == "bfloat16":
        import torch
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _adapt_device(obj: Any, kind: str, dt: DType, write: bool, read: bool) -> Buf:
    shape = tuple(obj.shape)
    contig = obj if _is_contiguous(obj, kind) else _contiguous(obj, kind)
    on_gpu = accelerator.is_device(obj, kind)
    if on_gpu:
        accelerator.synchronize(contig, kind)
    if on_gpu and _cuda_aware():
        buf = Buf(obj, kind, dt, _device_words(contig, kind, dt), shape)
        if write and contig is not obj:
            buf._after = lambda: _copy_into(obj, contig, kind)
        return buf
    nbytes = math.prod(shape) * dt.itemsize
    staging = _pool.acquire(nbytes, kind if on_gpu else "numpy")
    host_bytes = staging.array[:nbytes]
    dev_bytes = _byte_view(contig, kind)
    if read:
        _download(dev_bytes, host_bytes, kind)
    buf = Buf(obj, kind, dt, host_bytes.view(dt.host), shape)
    buf._staging = staging
    if write:
        def upload() -> None:
            _upload(host_bytes, dev_bytes, kind)
            if contig is not obj:
                _copy_into(obj, contig, kind)
        buf._after = upload
    return buf


def _is_contiguous(obj: Any, kind: str) -> bool:
    return obj.is_contiguous() if kind == "torch" else bool(obj.flags.c_contiguous)


def _contiguous(obj: Any, kind: str) -> Any:
    if kind == "torch":
        return obj.contiguous()
    return accelerator.cupy().ascontiguousarray(obj)


def _copy_into(dst: Any, src: Any, kind: str) -> None:
    if kind == "torch":
        dst.copy_(src)
    else:
        dst[...] = src


def _byte_view(obj: Any, kind: str) -> Any:
    if kind == "torch":
        import torch
        return obj.reshape(-1).view(torch.uint8)
    cp = accelerator.cupy()
    return obj.reshape(-1).view(cp.uint8)


def _device_words(obj: Any, kind: str, dt: DType) -> Any:
    # DLPack cannot describe every dtype (bfloat16 on older exporters), and MPI only needs
    # the address and the byte count, so device memory is handed over as raw words.
    if kind == "torch" and dt.name == "bfloat16":
        import torch
        return obj.view(torch.int16)
    return obj


def _download(dev_bytes: Any, host_bytes: np.ndarray, kind: str) -> None:
    if kind == "torch":
        import torch
        torch.from_numpy(host_bytes).copy_(dev_bytes)
    else:
        dev_bytes.get(out=host_bytes)


def _upload(host_bytes: np.ndarray, dev_bytes: Any, kind: str) -> None:
    if kind == "torch":
        import torch
        dev_bytes.copy_(torch.from_numpy(host_bytes))
    else:
        dev_bytes.set(host_bytes)


def _cuda_aware() -> bool:
    # accelerator caches the library query; the option is read each time so a change
    # of commlib.options.cuda_aware takes effect.
    return accelerator.cuda_aware(options.cuda_aware)[0]


def empty_like(buf: Buf, shape: tuple) -> Any:
    """A new uninitialized object of ``buf``'s kind, dtype and device, with ``shape``."""
    if buf.kind == "numpy":
        return np.empty(shape, dtype=buf.obj.dtype)
    if buf.kind == "torch":
        import torch
        return torch.empty(shape, dtype=buf.obj.dtype, device=buf.obj.device)
    return accelerator.cupy().empty(shape, dtype=buf.obj.dtype)


def output(like: Buf, shape: tuple, op: str, rank: int, out: Any = None) -> Buf:
    """The result buffer (``Buf.obj`` is what the collective returns): ``out`` when the
    caller gives one, which must be of the input's kind, device and dtype, with ``shape``'s
    element count (reusing it saves an allocation, and the page faults of fresh memory,
    per call); a new object otherwise."""
    if out is None:
        return adapt(empty_like(like, shape), "output", op, rank, write=True, read=False)
    buf = adapt(out, "out", op, rank, write=True, read=False)
    same_place = buf.kind == like.kind and (like.kind == "numpy" or
                                            str(out.device) == str(like.obj.device))
    if not same_place or buf.dt is not like.dt or buf.count != math.prod(shape):
        raise ValueError(f"{where(op, rank)}: argument 'out' must be a {like.kind} buffer of "
                         f"dtype {like.dt.name} on the input's device with shape "
                         f"{tuple(shape)}, got {buf.describe()}")
    return buf


class _Staging:
    __slots__ = ("array", "keep", "capacity", "key")

    def __init__(self, array: np.ndarray, keep: Any, capacity: int, key: str) -> None:
        self.array, self.keep, self.capacity, self.key = array, keep, capacity, key


class StagingPool:
    """Host buffers reused across calls, by power-of-two capacity and pinning kind.

    A buffer is owned by one operation from ``acquire`` until its ``finish``, so concurrent
    asynchronous collectives never share staging memory.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[str, int], list[_Staging]] = {}
        self._lock = threading.Lock()
        self.allocations = 0

    def acquire(self, nbytes: int, key: str) -> _Staging:
        capacity = 1 << max(nbytes - 1, 0).bit_length()
        with self._lock:
            free = self._free.get((key, capacity))
            if free:
                return free.pop()
        self.allocations += 1
        array, keep = _host_alloc(capacity, key)
        return _Staging(array, keep, capacity, key)

    def release(self, staging: _Staging) -> None:
        with self._lock:
            self._free.setdefault((staging.key, staging.capacity), []).append(staging)


def _host_alloc(capacity: int, key: str) -> tuple[np.ndarray, Any]:
    if key == "torch":
        import torch
        t = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        return t.numpy(), t
    if key == "cupy":
        import cupyx
        a = cupyx.empty_pinned((capacity,), dtype=np.uint8)
        return a, a
    a = np.empty(capacity, dtype=np.uint8)
    return a, a


_pool = StagingPool()
