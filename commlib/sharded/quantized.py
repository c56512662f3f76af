"""Compressed sharding collectives (ZeRO++'s qwZ and qgZ) over commlib.primitives.

Both use the min-max uint8 block quantizer of :mod:`kernels` (``quantize_minmax_uint8``):
each block of ``block`` consecutive elements is sent as one byte per element plus its
float32 ``(min, max)`` pair (8 bytes a block) and a 32-byte header, i.e. a buffer of
``kernels.compressed_nbytes(numel, block)`` bytes. An element ``x`` of a block with range
``[lo, hi]`` decodes to ``lo + q (hi - lo) / 255`` with ``q = rint((x - lo) 255 / (hi - lo))``,
so the error is at most ``(hi - lo) / 510`` (plus float32 rounding, a few ulps of
``max(|lo|, |hi|)``): :func:`error_bound` gives it element-wise.

* :func:`quantized_allgather` (qwZ): every rank quantizes its shard once, the uint8 buffers
  are all-gathered, every rank decodes every row: the result is identical on every rank
  (this rank's own slice decoded too), the input (the master shard) is only read.
* :func:`quantized_reduce_scatter` (qgZ): the full input is cut into ``n`` parts, part ``j``
  quantized and sent to rank ``j`` through one ``alltoall`` of uint8 buffers; the ``n``
  received parts are decoded and summed in float64, then divided by ``n`` for ``AVG``:
  the only loss is the quantization of each rank's part, never of the partial sums.
"""
from __future__ import annotations

import socket
import zlib
from typing import Any

import numpy as np
import torch

from ..options import options
from ..primitives import allgather, alltoall, group_from_ranks

#: elements per quantization block (DeepSpeed's ZeRO++ default group size is 2048 too)
DEFAULT_BLOCK = 2048
#: the values of ``weight_quantization`` and ``gradient_quantization``
QUANTIZATIONS = (None, "int8")


def _kernels() -> Any:
    import kernels   # imported on first use (Numba compiles on first load)
    return kernels


def wire_nbytes(numel: int, block: int) -> int:
    """Bytes one rank sends for ``numel`` elements quantized in blocks of ``block``."""
    return _kernels().compressed_nbytes(numel, block)


def quantize(x: torch.Tensor, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (1-D, floating point, any device) as one self-describing uint8 buffer."""
    return _kernels().quantize_minmax_uint8(x.detach().contiguous(), block, out=out,
                                            nonfinite="nan")


def dequantize(buf: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 values of a buffer made by :func:`quantize`."""
    return _kernels().dequantize_minmax_uint8(buf, out=out)


def error_bound(x: torch.Tensor, block: int) -> torch.Tensor:
    """Element-wise bound (float64, ``x``'s shape, 1-D) on ``|dequantize(quantize(x)) - x|``:
    ``(hi - lo) / 510`` of the element's block plus 8 float32 ulps of ``max(|lo|, |hi|)``."""
    v = x.detach().double().reshape(-1)
    n = v.numel()
    nb = -(-n // block)
    pad = torch.nn.functional.pad(v, (0, nb * block - n), value=float("nan"))
    blocks = pad.view(nb, block)
    hi = torch.nan_to_num(blocks, nan=-float("inf")).amax(1)
    lo = torch.nan_to_num(blocks, nan=float("inf")).amin(1)
    eps = torch.finfo(torch.float32).eps
    per = (hi - lo) / 510.0 + 8 * eps * torch.maximum(hi.abs(), lo.abs())
    return per.repeat_interleave(block)[:n]


class _Gathered:
    """A quantized all-gather under way: ``result()`` waits and decodes into ``out``."""

    def __init__(self, work: Any, recv: torch.Tensor, out: torch.Tensor, numel: int) -> None:
        self.work, self.recv, self.out, self.numel = work, recv, out, numel

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
            rows = self.out.view(-1, self.numel)
            if self.out.dtype == torch.float32:
                for r in range(rows.shape[0]):
                    dequantize(self.recv[r], out=rows[r])
            else:
                for r in range(rows.shape[0]):
                    rows[r].copy_(dequantize(self.recv[r]))
        return self.out


class _Started:
    """Future-like: ``result()`` gives the :class:`_Gathered` of a gather submitted to an
    engine (what ``FullyShardedDataParallel`` keeps for a chunk under way)."""

    def __init__(self, future: Any, recv: torch.Tensor, out: torch.Tensor,
                 numel: int) -> None:
        self.future, self.recv, self.out, self.numel = future, recv, out, numel

    def result(self) -> _Gathered:
        return _Gathered(self.future.result(), self.recv, self.out, self.numel)

    def exception(self, timeout: float | None = None) -> Any:
        return self.future.exception(timeout)


def start_allgather(engine: Any, shard: torch.Tensor, group: Any, block: int,
                    out: torch.Tensor) -> _Started:
    """:func:`quantized_allgather` with the all-gather run on ``engine`` (a
    ``commlib.ddp.engine.Engine``); ``shard`` is quantized here, at once, so later changes
    to it (an optimizer step) do not reach this gather."""
    send = quantize(shard, block)
    recv = torch.empty(group.size, send.numel(), dtype=torch.uint8, device=shard.device)
    return _Started(engine.submit(allgather, send, group, True, recv), recv, out,
                    shard.numel())


def quantized_allgather(shard: torch.Tensor, group: Any, block: int,
                        out: torch.Tensor | None = None, async_op: bool = False) -> Any:
    """All-gather the 1-D floating-point ``shard`` (``S`` elements, the same ``S`` on every
    rank) in uint8 blocks. Returns ``out`` (or a new tensor of ``n * S`` elements of
    ``shard``'s dtype): row ``r`` is rank ``r``'s shard decoded, identical on every rank;
    with ``async_op`` an object whose ``result()`` waits and returns it. Collective."""
    numel = shard.numel()
    if out is None:
        out = torch.empty(group.size * numel, dtype=shard.dtype, device=shard.device)
    send = quantize(shard, block)
    recv = torch.empty(group.size, send.numel(), dtype=torch.uint8, device=shard.device)
    work = allgather(send, group, True, recv)
    gathered = _Gathered(work, recv, out, numel)
    return gathered if async_op else gathered.result()


def quantized_reduce_scatter(full: torch.Tensor, group: Any, block: int,
                             average: bool = True) -> torch.Tensor:
    """Reduce-scatter the 1-D floating-point ``full`` (``n * S`` elements on every rank):
    returns this rank's ``S``-element part of the sum (``average``: the mean) over the
    ranks, in ``full``'s dtype, each rank's part quantized once for the wire and decoded
    and summed in float64 here. Blocking, collective (one ``alltoall`` of uint8)."""
    n = group.size
    part = full.numel() // n
    parts = full.detach().reshape(n, part)
    nbytes = wire_nbytes(part, block)
    send = torch.empty(n, nbytes, dtype=torch.uint8, device=full.device)
    for j in range(n):
        quantize(parts[j], block, out=send[j])
    recv = alltoall(send, group)
    acc = torch.zeros(part, dtype=torch.float64, device=full.device)
    for i in range(n):
        acc += dequantize(recv[i]).double()
    if average:
        acc /= n
    return acc.to(full.dtype)


def node_group(group: Any) -> Any:
    """hpZ: the ranks of ``group`` on this rank's node (``COMMLIB_LOCAL_SIZE`` blocks of
    consecutive world ranks when set, else the host), as a group of their own; collective
    over ``group``. ``ValueError`` on every rank when the nodes differ in size."""
    k = options.local_size
    me = group.ranks[group.rank]
    key = me // k if k else zlib.crc32(socket.gethostname().encode())
    keys = allgather(np.array([key], dtype=np.int64), group).reshape(-1)
    sizes = {int((keys == v).sum()) for v in keys}
    if len(sizes) != 1:
        raise ValueError(f"FullyShardedDataParallel (rank {group.rank}): argument "
                         f"'secondary_shard'='node' needs nodes of equal size in the group, "
                         f"got {sorted(sizes)} ranks per node")
    return group_from_ranks([w for w, v in zip(group.ranks, keys) if v == key], group)


def quantization_blocks(strategy: str, weights: Any, grads: Any, block: Any,
                  rank: int) -> tuple[int | None, int | None]:
    """The block sizes of weight and gradient quantization (``None``: off), or
    ``ValueError`` naming the argument."""
    where = f"FullyShardedDataParallel (rank {rank}): argument"
    for name, value in (("weight_quantization", weights), ("gradient_quantization", grads)):
        if value not in QUANTIZATIONS:
            raise ValueError(f"{where} '{name}' must be one of {list(QUANTIZATIONS)}, got "
                             f"{value!r}")
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 1 << 24:
        raise ValueError(f"{where} 'quantization_block_size' must be an int in [1, 2**24], "
                         f"got {block!r}")
    if weights is not None and strategy != "FULL_SHARD":
        raise ValueError(f"{where} 'weight_quantization' needs sharding_strategy "
                         f"FULL_SHARD (the gathered weights of {strategy} would "
                         f"replace the full-precision master shard), got {strategy}")
    if grads is not None and strategy == "NO_SHARD":
        raise ValueError(f"{where} 'gradient_quantization' needs a sharded strategy "
                         f"(FULL_SHARD or SHARD_GRAD_OP), got NO_SHARD")
    return (block if weights else None), (block if grads else None)
