"""Compressed allreduce: gradients travel as min-max uint8 codes (or 1-bit signs).

With ``n`` ranks and a flattened float input of ``L`` elements, padded (edge value) to
``n * P`` with ``P = ceil(L / n)``:

1. every rank compresses each of its ``n`` parts of ``P`` elements separately (all parts
   compress to the same byte length) and an **alltoall** hands part ``j`` of every rank to
   rank ``j``;
2. rank ``j`` decompresses the ``n`` versions of its part, adds them in rank order (then
   divides by ``n`` for AVG), and compresses the reduced part again;
3. an **allgather** of the compressed reduced parts; every rank decompresses all of them
   (its own included) into the result, so every rank ends with bitwise-identical values.

On the wire each rank sends about ``2 (n-1)/n`` of the compressed size: a quarter of a
float32 allreduce for ``minmax_uint8`` (plus 8 bytes per chunk and a 32-byte header per
part), a thirty-second for ``sign1``. ``sign1`` keeps error-feedback residuals (the
worker's on the whole padded input, the server's on the rank's reduced part) in a
:class:`CompressionState` the caller owns, one per tensor. With ``hierarchical=True`` the
node's ranks first reduce in full precision to the node leader, leaders run the
compressed allreduce, and leaders broadcast the result inside the node.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

import kernels

from ..errors import where
from ..reduce_ops import ReduceOp, as_reduce_op
from ._base import resolve
from .allgather import allgather
from .alltoall import alltoall
from .broadcast import broadcast
from .reduce import reduce

METHODS = ("minmax_uint8", "sign1")


class CompressionState:
    """Error-feedback residuals of one tensor under ``sign1`` (created empty; sized on
    first use; reset with :meth:`reset`)."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.server: Any = None

    def reset(self) -> None:
        self.worker = self.server = None


def compressed_allreduce(tensor: Any, op: ReduceOp = ReduceOp.AVG, group: Any = None,
                         method: str = "minmax_uint8", chunk_size: int = 2048,
                         state: CompressionState | None = None,
                         hierarchical: bool = False) -> Any:
    """Allreduce ``tensor`` (floating point, any shape; numpy, torch CPU/CUDA or cupy) in
    place through compressed exchanges (see the module docstring). ``op``: SUM or AVG.
    ``method``: ``"minmax_uint8"`` or ``"sign1"`` (needs ``state``). Every rank of the
    group calls it with the same shape, dtype and arguments and ends with identical
    values. Returns ``tensor``."""
    comm = resolve(group, "compressed_allreduce")
    op = as_reduce_op(op, "compressed_allreduce", comm.rank)
    _check_args(tensor, op, method, state, comm.rank)
    if comm.size == 1:
        return tensor
    if hierarchical:
        return _hierarchical(tensor, op, comm, method, chunk_size, state)
    flat = _float32_flat(tensor)
    result = _exchange(flat, op is ReduceOp.AVG, comm, method, chunk_size, state)
    _write_back(tensor, result[:flat.shape[0]])
    return tensor


def _check_args(tensor: Any, op: ReduceOp, method: str, state: Any, rank: int) -> None:
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"{where('compressed_allreduce', rank)}: argument 'op' must be "
                         f"ReduceOp.SUM or ReduceOp.AVG, got {op!r}")
    if method not in METHODS:
        raise ValueError(f"{where('compressed_allreduce', rank)}: argument 'method' must be "
                         f"one of {METHODS}, got {method!r}")
    if method == "sign1" and not isinstance(state, CompressionState):
        raise ValueError(f"{where('compressed_allreduce', rank)}: method 'sign1' keeps error "
                         f"feedback; pass state=CompressionState() (one per tensor)")
    if "float" not in str(tensor.dtype):
        raise TypeError(f"{where('compressed_allreduce', rank)}: argument 'tensor' must be "
                        f"floating point, got {tensor.dtype}")


def _hierarchical(tensor: Any, op: ReduceOp, comm: Any, method: str, chunk_size: int,
                  state: CompressionState | None) -> Any:
    local, leaders = comm.node()
    reduce(tensor, dst=0, op=ReduceOp.SUM, group=local)
    if leaders is not None and leaders.size > 1:
        flat = _float32_flat(tensor)
        result = _exchange(flat, False, leaders, method, chunk_size, state)
        _write_back(tensor, result[:flat.shape[0]])
    broadcast(tensor, src=0, group=local)
    if op is ReduceOp.AVG:
        tensor /= comm.size
    return tensor


class _Workspace:
    """Buffers of one exchange shape, reused call after call: fresh multi-megabyte
    allocations cost page faults that, on virtual machines, took longer than the
    compression itself (14 ms for 7 MB here)."""

    def __init__(self, like: Any, n: int, part: int, nbytes: int) -> None:
        self.padded = _empty(like, n * part, "float32")
        self.codes = _empty(like, n * nbytes, "uint8").reshape(n, nbytes)
        self.received = _empty(like, n * nbytes, "uint8").reshape(n, nbytes)
        self.mine = _empty(like, nbytes, "uint8")
        self.gathered = _empty(like, n * nbytes, "uint8").reshape(n, nbytes)
        self.acc = _empty(like, part, "float32")
        self.scratch = _empty(like, part, "float32")
        self.out = _empty(like, n * part, "float32")


_workspaces = threading.local()


def _workspace(like: Any, n: int, part: int, method: str, chunk_size: int) -> _Workspace:
    """This thread's workspace for the shape (one per thread: the DDP communication thread
    and the main thread never share buffers)."""
    cache = getattr(_workspaces, "cache", None)
    if cache is None:
        cache = _workspaces.cache = {}
    key = (_place(like), n, part, method, chunk_size)
    if key not in cache:
        if len(cache) >= 64:  # bounded: shapes come from a model's buckets
            cache.clear()
        nbytes = kernels.compressed_nbytes(part, chunk_size, method)
        cache[key] = _Workspace(like, n, part, nbytes)
    return cache[key]


def workspace_bytes() -> int:
    """Bytes held by the calling thread's cached workspaces."""
    cache = getattr(_workspaces, "cache", None) or {}
    return sum(_nbytes(buf) for ws in cache.values() for buf in vars(ws).values())


def release_workspaces() -> int:
    """Drop the calling thread's cached workspaces (the next call allocates anew); returns
    the bytes released. Algorithms call it on the thread that ran their exchanges when they
    are torn down, so a long-lived thread does not keep them."""
    released = workspace_bytes()
    _workspaces.cache = {}
    return released


def _nbytes(buf: Any) -> int:
    return buf.numel() * buf.element_size() if _is_torch(buf) else int(buf.nbytes)


def _exchange(flat: Any, average: bool, comm: Any, method: str, chunk_size: int,
              state: CompressionState | None) -> Any:
    n = comm.size
    part = -(-flat.shape[0] // n) if flat.shape[0] else 0
    ws = _workspace(flat, n, part, method, chunk_size)
    _pad_into(ws.padded, flat)
    for j in range(n):
        _compress(ws.padded[j * part:(j + 1) * part], ws.codes[j], method, chunk_size, state,
                  worker=True, offset=j * part, total=n * part)
    alltoall(ws.codes, group=comm, out=ws.received)
    _reduce_parts(ws, n, part, average)
    _compress(ws.acc, ws.mine, method, chunk_size, state, worker=False)
    allgather(ws.mine, group=comm, out=ws.gathered)
    for j in range(n):
        kernels.decompress(ws.gathered[j], out=ws.out[j * part:(j + 1) * part])
    return ws.out


def _compress(x: Any, out: Any, method: str, chunk_size: int,
              state: CompressionState | None, worker: bool, offset: int = 0,
              total: int | None = None) -> None:
    if method == "minmax_uint8":
        kernels.quantize_minmax_uint8(x, chunk_size, out=out)
        return
    if worker:
        if state.worker is None or state.worker.shape[0] != total:
            state.worker = _zeros(x, total)
        residual = state.worker[offset:offset + x.shape[0]]
    else:
        if state.server is None or state.server.shape[0] != x.shape[0]:
            state.server = _zeros(x, x.shape[0])
        residual = state.server
    kernels.compress_sign(x, residual, chunk_size, out=out)


def _reduce_parts(ws: _Workspace, n: int, part: int, average: bool) -> None:
    """``ws.acc`` = sum (or mean) of the ``n`` received versions of this rank's part, added
    in rank order so the sum is the same on every run."""
    ws.acc[...] = 0
    for j in range(n):
        ws.acc += kernels.decompress(ws.received[j], out=ws.scratch)
    if average:
        ws.acc /= n


# -- array helpers for numpy, torch and cupy alike --------------------------------------

def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _empty(like: Any, n: int, dtype: str) -> Any:
    if _is_torch(like):
        import torch
        return torch.empty(n, dtype=getattr(torch, dtype), device=like.device)
    xp = _xp(like)
    return xp.empty(n, dtype=dtype)


def _zeros(like: Any, n: int) -> Any:
    out = _empty(like, n, "float32")
    out[...] = 0
    return out


def _xp(like: Any) -> Any:
    if isinstance(like, np.ndarray):
        return np
    from .. import accelerator
    return accelerator.cupy()


def _float32_flat(tensor: Any) -> Any:
    if _is_torch(tensor):
        return tensor.detach().reshape(-1).float()
    return tensor.reshape(-1).astype("float32", copy=False)


def _pad_into(out: Any, flat: Any) -> None:
    """Copy ``flat`` into ``out``; the tail repeats the last value, which widens no chunk's
    min-max range."""
    length = flat.shape[0]
    out[:length] = flat
    if out.shape[0] > length:
        out[length:] = flat[length - 1] if length else 0


def _place(like: Any) -> str:
    """Kind and device of an array, as a cache key."""
    if _is_torch(like):
        return f"torch:{like.device}"
    return "numpy" if isinstance(like, np.ndarray) else f"cupy:{like.device.id}"


def _write_back(tensor: Any, values: Any) -> None:
    if _is_torch(tensor):
        with __import__("torch").no_grad():
            tensor.copy_(values.view(tensor.shape))
    else:
        tensor[...] = values.reshape(tensor.shape)
