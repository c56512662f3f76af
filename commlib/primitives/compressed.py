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

Non-finite input (``nonfinite="propagate"``, the default): a chunk holding NaN or Inf on
any rank travels as a NaN chunk (the kernels' ``nonfinite="nan"``: NaN parameters in the
chunk's header, which the payload carries anyway), so its reduction and then every rank's
result are NaN in that chunk: non-finite input anywhere gives non-finite output
everywhere, identically, with no extra message and no extra pass over the data. A call
whose result is not finite changes no :class:`CompressionState`. ``nonfinite="raise"``
is the plain path: the kernel raises ``ValueError`` on the rank whose input is not finite
(only there) and residuals are updated in place.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..base.errors import where
from ..base.reduce_ops import ReduceOp, as_reduce_op
from ._base import resolve
from .allgather import allgather
from .alltoall import alltoall
from .broadcast import broadcast
from .finite import all_finite
from .reduce import reduce
from .work import turn

METHODS = ("minmax_uint8", "sign1")
NONFINITE = ("propagate", "raise")


def _kernels():
    """The compression kernels, imported on first use: Numba then loads with the first
    compressed exchange instead of at ``import commlib``."""
    from .. import kernels
    return kernels


class CompressionState:
    """Error-feedback residuals of one tensor under ``sign1`` (created empty; sized on
    first use; reset with :meth:`reset`).

    Under ``nonfinite="propagate"`` a call writes its residual updates into second
    buffers (the kernel reads ``worker``/``server`` and writes those, no copy) and
    ``finite`` tells whether its result was finite (the same on every rank). With
    ``commit=True`` the updates replace ``worker``/``server`` when it was, and are
    dropped when it was not; with ``commit=False`` they wait for :meth:`commit` (or
    :meth:`discard`), so that a caller exchanging several tensors per step (one state
    each) can keep all of the step's updates or none."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.server: Any = None
        self.finite = True
        self._next: list[Any] = [None, None]  # scratch worker, server residuals
        self._staged = False

    def reset(self) -> None:
        self.worker = self.server = None
        self._next = [None, None]
        self._staged = False
        self.finite = True

    def commit(self) -> None:
        """Keep the updates of the last call made with ``commit=False`` (if its result was
        finite; otherwise there is nothing to keep)."""
        if self._staged:
            self._staged = False
            (self.worker, self._next[0]), (self.server, self._next[1]) = \
                (self._next[0], self.worker), (self._next[1], self.server)

    def discard(self) -> None:
        """Drop the updates of the last call made with ``commit=False``."""
        self._staged = False

    def _sized(self, like: Any, worker_n: int, server_n: int, scratch: bool) -> list:
        """[worker, server, next worker, next server]: the committed residuals (zeros when
        sized anew) and, with ``scratch``, the buffers the kernel writes the updated ones
        into (no copy: the kernel reads the committed ones and writes these)."""
        self._staged = False
        if self.worker is None or self.worker.shape[0] != worker_n:
            self.worker = _zeros(like, worker_n)
        if self.server is None or self.server.shape[0] != server_n:
            self.server = _zeros(like, server_n)
        buffers = [self.worker, self.server, None, None]
        if scratch:
            for k, committed in enumerate((self.worker, self.server)):
                if self._next[k] is None or self._next[k].shape[0] != committed.shape[0]:
                    self._next[k] = _empty(like, committed.shape[0], "float32")
                buffers[2 + k] = self._next[k]
        return buffers

    def _finished(self, finite: bool, commit: bool) -> None:
        self.finite = finite
        self._staged = finite
        if commit:
            self.commit()


def compressed_allreduce(tensor: Any, op: ReduceOp = ReduceOp.AVG, group: Any = None,
                         method: str = "minmax_uint8", chunk_size: int = 2048,
                         state: CompressionState | None = None,
                         hierarchical: bool = False, nonfinite: str = "propagate",
                         commit: bool = True) -> Any:
    """Allreduce ``tensor`` (floating point, any shape; numpy, torch CPU/CUDA or cupy) in
    place through compressed exchanges (see the module docstring). ``op``: SUM or AVG.
    ``method``: ``"minmax_uint8"`` or ``"sign1"`` (needs ``state``). Every rank of the
    group calls it with the same shape, dtype and arguments and ends with identical
    values. ``nonfinite``: ``"propagate"`` (NaN or Inf on any rank gives NaN in the
    affected chunks on every rank, and ``state`` is not changed) or ``"raise"``.
    ``commit``: see :class:`CompressionState`. Returns ``tensor``."""
    comm = resolve(group, "compressed_allreduce")
    op = as_reduce_op(op, "compressed_allreduce", comm.rank)
    _check_args(tensor, op, method, state, comm.rank, nonfinite)
    if comm.size == 1:
        return tensor
    if hierarchical:
        return _hierarchical(tensor, op, comm, method, chunk_size, state, nonfinite, commit)
    flat = _float32_flat(tensor)
    result, finite = _exchange(flat, op is ReduceOp.AVG, comm, method, chunk_size, state,
                               nonfinite)
    _write_back(tensor, result[:flat.shape[0]])
    if state is not None and nonfinite == "propagate":
        state._finished(finite, commit)
    return tensor


def _check_args(tensor: Any, op: ReduceOp, method: str, state: Any, rank: int,
                nonfinite: str) -> None:
    if nonfinite not in NONFINITE:
        raise ValueError(f"{where('compressed_allreduce', rank)}: argument 'nonfinite' must "
                         f"be one of {NONFINITE}, got {nonfinite!r}")
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
                  state: CompressionState | None, nonfinite: str, commit: bool) -> Any:
    local, leaders = comm.node()
    # after every async hierarchical allreduce issued before (they share these
    # communicators; see commlib.primitives.work)
    with turn(*(c for c in (local, leaders) if c is not None)):
        reduce(tensor, dst=0, op=ReduceOp.SUM, group=local)
        if leaders is not None and leaders.size > 1:
            flat = _float32_flat(tensor)
            result, _ = _exchange(flat, False, leaders, method, chunk_size, state, nonfinite)
            _write_back(tensor, result[:flat.shape[0]])
        broadcast(tensor, src=0, group=local)
    if op is ReduceOp.AVG:
        tensor /= comm.size
    if state is not None and nonfinite == "propagate":
        # The broadcast result is the same everywhere, so is this decision.
        state._finished(all_finite(tensor), commit)
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
        nbytes = _kernels().compressed_nbytes(part, chunk_size, method)
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
              state: CompressionState | None, nonfinite: str) -> tuple[Any, bool]:
    """(result, whether it is finite: the same on every rank; only worked out when there
    is a ``state`` to keep or not)."""
    n = comm.size
    part = -(-flat.shape[0] // n) if flat.shape[0] else 0
    ws = _workspace(flat, n, part, method, chunk_size)
    mode = "nan" if nonfinite == "propagate" else "raise"
    worker, server, worker_out, server_out = (
        state._sized(flat, n * part, part, scratch=mode == "nan") if method == "sign1"
        else [None] * 4)
    _pad_into(ws.padded, flat)
    for j in range(n):
        cut = slice(j * part, (j + 1) * part)
        _compress(ws.padded[cut], ws.codes[j], method, chunk_size,
                  None if worker is None else worker[cut],
                  None if worker_out is None else worker_out[cut], mode)
    alltoall(ws.codes, group=comm, out=ws.received)
    _reduce_parts(ws, n, part, average)
    _compress(ws.acc, ws.mine, method, chunk_size, server, server_out, mode)
    allgather(ws.mine, group=comm, out=ws.gathered)
    for j in range(n):
        _kernels().decompress(ws.gathered[j], out=ws.out[j * part:(j + 1) * part])
    finite = (state is None or mode == "raise"
              or all(_kernels().all_chunks_finite(ws.gathered[j]) for j in range(n)))
    return ws.out, finite


def _compress(x: Any, out: Any, method: str, chunk_size: int, residual: Any,
              residual_out: Any, mode: str) -> None:
    """``residual_out`` None: the residual is updated in place."""
    if method == "minmax_uint8":
        _kernels().quantize_minmax_uint8(x, chunk_size, out=out, nonfinite=mode)
    else:
        _kernels().compress_sign(x, residual, chunk_size, out=out, nonfinite=mode,
                                 residual_out=residual_out)


def _reduce_parts(ws: _Workspace, n: int, part: int, average: bool) -> None:
    """``ws.acc`` = sum (or mean) of the ``n`` received versions of this rank's part, added
    in rank order so the sum is the same on every run."""
    ws.acc[...] = 0
    for j in range(n):
        ws.acc += _kernels().decompress(ws.received[j], out=ws.scratch)
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
    from ..base import accelerator
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
