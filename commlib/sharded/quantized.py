"""Compressed sharding collectives (ZeRO++'s qwZ and qgZ) over commlib.primitives.

Both use the min-max block quantizers of :mod:`commlib.kernels`: ``"int8"``
(``quantize_minmax_uint8``, one byte an element, 255 levels) and, for gradients,
``"int4"`` (``quantize_minmax_int4``, two codes a byte, 15 levels, even block sizes). Each
block of ``block`` consecutive elements is sent as its codes plus its float32 ``(min, max)``
pair (8 bytes a block) and a 32-byte header, i.e. a buffer of
``kernels.compressed_nbytes(numel, block, kind)`` bytes. An element ``x`` of a block with
range ``[lo, hi]`` decodes to ``lo + q (hi - lo) / L`` with ``q = rint((x - lo) L / (hi -
lo))`` (``L`` the levels), so the error is at most ``(hi - lo) / (2 L)`` (plus float32
rounding, a few ulps of ``max(|lo|, |hi|)``): :func:`error_bound` gives it element-wise.

* :func:`quantized_allgather` (qwZ): every rank quantizes its shard once, the uint8 buffers
  are all-gathered, every rank decodes every row: the result is identical on every rank
  (this rank's own slice decoded too), the input (the master shard) is only read.
* :func:`quantized_reduce_scatter` (qgZ): the full input is cut into ``n`` parts, part ``j``
  quantized and sent to rank ``j`` through one ``alltoall`` of uint8 buffers; the ``n``
  received parts are decoded and summed in float64, then divided by ``n`` for ``AVG``:
  the only loss is the quantization of each rank's part, never of the partial sums.
* :func:`hierarchical_reduce_scatter` (qgZ across nodes, :class:`Hierarchy`): first a
  full-precision ``reduce_scatter`` inside the node (``m`` ranks), which leaves each rank
  the node's sums of the parts of the ranks with its local index on every node; then one
  quantized ``alltoall`` among those ``k = n / m`` ranks (one a node), decoded and summed
  in float64. Only the node sums are quantized (once each); the inter-node bytes are
  ``k`` quantized parts a rank instead of ``n``. With one node nothing is quantized.
"""
from __future__ import annotations

import socket
import zlib
from typing import Any

import numpy as np
import torch

from ..base.options import options
from ..base.reduce_ops import ReduceOp
from ..primitives import allgather, alltoall, group_from_ranks, reduce_scatter

#: elements per quantization block (DeepSpeed's ZeRO++ default group size is 2048 too)
DEFAULT_BLOCK = 2048
#: the values of ``weight_quantization``
QUANTIZATIONS = (None, "int8")
#: the values of ``gradient_quantization``
GRADIENT_QUANTIZATIONS = (None, "int8", "int4")
#: the kernels' layout and the levels of each quantization
KINDS = {"int8": "minmax_uint8", "int4": "minmax_int4"}
LEVELS = {"int8": 255, "int4": 15}


def _kernels() -> Any:
    from .. import kernels  # imported on first use (Numba compiles on first load)
    return kernels


def wire_nbytes(numel: int, block: int, bits: str = "int8") -> int:
    """Bytes one rank sends for ``numel`` elements quantized (``bits``) in blocks of
    ``block``."""
    return _kernels().compressed_nbytes(numel, block, KINDS[bits])


def quantize(x: torch.Tensor, block: int, out: torch.Tensor | None = None,
             bits: str = "int8") -> torch.Tensor:
    """``x`` (1-D, floating point, any device) as one self-describing uint8 buffer
    (``bits``: ``"int8"`` or ``"int4"``)."""
    x = x.detach().contiguous()
    if bits == "int4":
        return _kernels().quantize_minmax_int4(x, block, out=out, nonfinite="nan")
    return _kernels().quantize_minmax_uint8(x, block, out=out, nonfinite="nan")


def dequantize(buf: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 values of a buffer made by :func:`quantize` (its header names the kind)."""
    return _kernels().decompress(buf, out=out)


def error_bound(x: torch.Tensor, block: int, bits: str = "int8") -> torch.Tensor:
    """Element-wise bound (float64, ``x``'s shape, 1-D) on ``|dequantize(quantize(x)) - x|``:
    ``(hi - lo) / (2 L)`` of the element's block (``L`` = 255 levels for int8, 15 for int4)
    plus 8 float32 ulps of ``max(|lo|, |hi|)``."""
    v = x.detach().double().reshape(-1)
    n = v.numel()
    nb = -(-n // block)
    pad = torch.nn.functional.pad(v, (0, nb * block - n), value=float("nan"))
    blocks = pad.view(nb, block)
    hi = torch.nan_to_num(blocks, nan=-float("inf")).amax(1)
    lo = torch.nan_to_num(blocks, nan=float("inf")).amin(1)
    eps = torch.finfo(torch.float32).eps
    per = (hi - lo) / (2.0 * LEVELS[bits]) + 8 * eps * torch.maximum(hi.abs(), lo.abs())
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


def _quantized_alltoall_sum(parts: torch.Tensor, group: Any, block: int,
                            bits: str) -> torch.Tensor:
    """Row ``j`` of ``parts`` (``group.size`` rows) quantized and sent to rank ``j``; the
    float64 sum of the decoded rows this rank receives."""
    n, part = parts.shape
    send = torch.empty(n, wire_nbytes(part, block, bits), dtype=torch.uint8,
                       device=parts.device)
    for j in range(n):
        quantize(parts[j], block, out=send[j], bits=bits)
    recv = alltoall(send, group)
    acc = torch.zeros(part, dtype=torch.float64, device=parts.device)
    for i in range(n):
        acc += dequantize(recv[i]).double()
    return acc


def quantized_reduce_scatter(full: torch.Tensor, group: Any, block: int,
                             average: bool = True, bits: str = "int8") -> torch.Tensor:
    """Reduce-scatter the 1-D floating-point ``full`` (``n * S`` elements on every rank):
    returns this rank's ``S``-element part of the sum (``average``: the mean) over the
    ranks, in ``full``'s dtype, each rank's part quantized (``bits``) once for the wire and
    decoded and summed in float64 here. Blocking, collective (one ``alltoall`` of uint8)."""
    n = group.size
    acc = _quantized_alltoall_sum(full.detach().reshape(n, -1), group, block, bits)
    if average:
        acc /= n
    return acc.to(full.dtype)


class Hierarchy:
    """The two tiers of a hierarchical reduce-scatter over ``group`` (collective over it):
    :attr:`node` (this rank's node: ``COMMLIB_LOCAL_SIZE`` blocks of consecutive world
    ranks when set, else the host; nodes of equal size ``m``) and :attr:`cross` (the ranks
    with this rank's local index, one a node, in node order); :attr:`order` is the order of
    the ``n`` parts in the intra-node reduce-scatter's input (local index major). Frees
    both groups in :meth:`free`. ``ValueError`` on every rank when the nodes differ in
    size."""

    def __init__(self, group: Any, who: str = "gradient_hierarchy") -> None:
        n = group.size
        keys = _node_keys(group)
        nodes = list(dict.fromkeys(int(v) for v in keys))   # by first group position
        members = {v: [p for p in range(n) if keys[p] == v] for v in nodes}
        sizes = {len(ps) for ps in members.values()}
        if len(sizes) != 1:
            raise ValueError(f"FullyShardedDataParallel (rank {group.rank}): argument "
                             f"'{who}'='node' needs nodes of equal size in the group, got "
                             f"{sorted(len(ps) for ps in members.values())} ranks per node")
        m = sizes.pop()
        mine = members[int(keys[group.rank])]
        local = mine.index(group.rank)
        self.size, self.nodes, self.local_size = n, len(nodes), m
        self.order = [members[v][j] for j in range(m) for v in nodes]
        self.node = group_from_ranks([group.ranks[p] for p in mine], group)
        self.cross = group_from_ranks([group.ranks[members[v][local]] for v in nodes], group)

    def free(self) -> None:
        self.node.free()
        self.cross.free()


def hierarchical_reduce_scatter(full: torch.Tensor, hierarchy: Hierarchy, block: int,
                                average: bool = True, bits: str = "int8") -> torch.Tensor:
    """:func:`quantized_reduce_scatter`'s result (this rank's part ``S`` of the sum or the
    mean over the ``n`` ranks, ``full``'s dtype), in two tiers: a full-precision
    ``reduce_scatter`` (SUM) of the reordered parts inside the node, then the quantized
    ``alltoall`` of the node sums among :attr:`Hierarchy.cross`. Blocking, collective."""
    n = hierarchy.size
    parts = full.detach().reshape(n, -1)
    node_sums = parts[hierarchy.order].reshape(-1)
    if hierarchy.local_size > 1:
        node_sums = reduce_scatter(node_sums, ReduceOp.SUM, hierarchy.node)
    node_sums = node_sums.reshape(hierarchy.nodes, -1)
    if hierarchy.nodes > 1:
        acc = _quantized_alltoall_sum(node_sums, hierarchy.cross, block, bits)
    else:
        acc = node_sums[0].double()
    if average:
        acc /= n
    return acc.to(full.dtype)


def _node_keys(group: Any) -> np.ndarray:
    """Per group position, a key naming its node (collective over ``group``)."""
    k = options.local_size
    me = group.ranks[group.rank]
    key = me // k if k else zlib.crc32(socket.gethostname().encode())
    return allgather(np.array([key], dtype=np.int64), group).reshape(-1)


def node_group(group: Any) -> Any:
    """hpZ: the ranks of ``group`` on this rank's node (``COMMLIB_LOCAL_SIZE`` blocks of
    consecutive world ranks when set, else the host), as a group of their own; collective
    over ``group``. ``ValueError`` on every rank when the nodes differ in size."""
    keys = _node_keys(group)
    key = keys[group.rank]
    sizes = {int((keys == v).sum()) for v in keys}
    if len(sizes) != 1:
        raise ValueError(f"FullyShardedDataParallel (rank {group.rank}): argument "
                         f"'secondary_shard'='node' needs nodes of equal size in the group, "
                         f"got {sorted(sizes)} ranks per node")
    return group_from_ranks([w for w, v in zip(group.ranks, keys) if v == key], group)


def quantization_blocks(strategy: str, weights: Any, grads: Any, block: Any,
                        rank: int, hierarchy: Any = None) -> tuple[int | None, int | None]:
    """The block sizes of weight and gradient quantization (``None``: off), or
    ``ValueError`` naming the argument."""
    where = f"FullyShardedDataParallel (rank {rank}): argument"
    for name, value, allowed in (("weight_quantization", weights, QUANTIZATIONS),
                                 ("gradient_quantization", grads, GRADIENT_QUANTIZATIONS)):
        if not any(value is a or (isinstance(value, str) and value == a) for a in allowed):
            raise ValueError(f"{where} '{name}' must be one of {list(allowed)}, got "
                             f"{value!r}")
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 1 << 24:
        raise ValueError(f"{where} 'quantization_block_size' must be an int in [1, 2**24], "
                         f"got {block!r}")
    if grads == "int4" and block % 2:
        raise ValueError(f"{where} 'quantization_block_size' must be even with "
                         f"gradient_quantization='int4' (two codes a byte), got {block}")
    if hierarchy not in (None, "node"):
        raise ValueError(f"{where} 'gradient_hierarchy' must be None or 'node', got "
                         f"{hierarchy!r}")
    if hierarchy is not None and grads is None:
        raise ValueError(f"{where} 'gradient_hierarchy' needs gradient_quantization "
                         f"(the full-precision reduce-scatter is MPI's own), got None")
    if weights is not None and strategy != "FULL_SHARD":
        raise ValueError(f"{where} 'weight_quantization' needs sharding_strategy "
                         f"FULL_SHARD (the gathered weights of {strategy} would "
                         f"replace the full-precision master shard), got {strategy}")
    if grads is not None and strategy == "NO_SHARD":
        raise ValueError(f"{where} 'gradient_quantization' needs a sharded strategy "
                         f"(FULL_SHARD or SHARD_GRAD_OP), got NO_SHARD")
    return (block if weights else None), (block if grads else None)
