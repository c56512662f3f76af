"""Peer exchange for decentralized training.

``peer_average(t, "all")`` averages with every rank (an allreduce). ``"shift_one"`` averages
with exactly one peer per step, pairs disjoint, the peer changing every step: step ``s``
uses round ``s mod (n - 1)`` of the circle-method round-robin schedule, so over ``n - 1``
consecutive steps every pair of ranks meets once. For an odd world size the schedule is
built for ``n + 1`` slots and the rank paired with the empty slot sits the step out (keeps
its tensor), a different rank every step; world size 1 is a no-op.
"""
from __future__ import annotations

from typing import Any

from ..base.errors import NonFiniteError, where
from ..base.reduce_ops import ReduceOp
from ._base import resolve
from .allreduce import allreduce
from .p2p import sendrecv

PEER_MODES = ("all", "shift_one")


def shift_one_peer(rank: int, size: int, step: int) -> int | None:
    """The peer of ``rank`` at ``step`` under ``shift_one`` (``None``: sits out)."""
    if size < 2:
        return None
    slots = size + (size % 2)
    rounds = slots - 1
    r = step % rounds
    # Circle method: slot 0 fixed, the others rotate by one position per round.
    ring = [0] + [1 + (i + r) % rounds for i in range(rounds)]
    position = ring.index(rank)
    peer = ring[slots - 1 - position]
    return peer if peer < size else None


def ring_neighbors(rank: int, size: int) -> tuple[int, int]:
    """(left, right) neighbours on the ring ``0 -> 1 -> ... -> size-1 -> 0``."""
    return (rank - 1) % size, (rank + 1) % size


def peer_average(tensor: Any, mode: str, step: int = 0, group: Any = None,
                 scratch: Any = None) -> Any:
    """Average ``tensor`` in place with the peers ``mode`` selects at ``step``.

    ``"all"``: the average over the group (every rank gets the same result). ``"shift_one"``:
    the average with this step's single peer (see :func:`shift_one_peer`); both members of a
    pair end with the same values. ``scratch`` (same shape and dtype as ``tensor``) receives
    the peer's tensor; one is allocated when omitted. Floating-point buffers only.
    Returns ``tensor``.
    """
    if mode not in PEER_MODES:
        raise ValueError(f"peer_average: argument 'mode' must be one of {PEER_MODES}, "
                         f"got {mode!r}")
    if mode == "all":
        return allreduce(tensor, op=ReduceOp.AVG, group=group)
    comm = resolve(group, "peer_average")
    peer = shift_one_peer(comm.rank, comm.size, step)
    if peer is None:
        return tensor
    other = scratch if scratch is not None else _empty_like(tensor)
    sendrecv(tensor, peer, other, peer, tag=step % 32768, group=group)
    # (a + b) / 2 on both sides, in the same operand order, so both peers agree bitwise.
    low, high = (tensor, other) if comm.rank < peer else (other, tensor)
    _average_into(tensor, low, high)
    return tensor


def _empty_like(t: Any) -> Any:
    import numpy as np
    return np.empty_like(t) if isinstance(t, np.ndarray) else t.new_empty(t.shape)


def _average_into(out: Any, a: Any, b: Any) -> None:
    import numpy as np
    if isinstance(out, np.ndarray):
        np.add(a, b, out=out)
        out *= 0.5
    else:
        out.copy_(a.add(b).mul_(0.5))


def compressed_ring_exchange(tensor: Any, group: Any = None,
                             chunk_size: int = 2048) -> tuple[Any, Any, Any]:
    """Send ``tensor`` (floating point) min-max uint8-compressed to both ring neighbours and
    receive theirs. Returns ``(mine, from_left, from_right)``, all decompressed float32 of
    ``tensor``'s kind: ``mine`` is exactly what the neighbours decode from this rank, so
    replicas kept by both sides of a link stay identical. With 2 ranks both neighbours are
    the same rank (one exchange); with 1 rank ``from_left``/``from_right`` are ``mine``.

    A tensor with NaN or Inf still travels (as NaN chunks), so the exchange completes on
    both sides of every link; then this rank and its neighbours raise
    :class:`~commlib.base.errors.NonFiniteError` (``.ranks``: the ring ranks whose tensors were
    not finite) instead of returning anything."""
    from .. import kernels
    comm = resolve(group, "compressed_ring_exchange")
    flat = tensor.reshape(-1)
    codes = kernels.quantize_minmax_uint8(flat, chunk_size, nonfinite="nan")
    if comm.size == 1:
        _check_finite(comm, [(comm.rank, codes)])
        mine = kernels.dequantize_minmax_uint8(codes)
        return mine, mine, mine
    left, right = ring_neighbors(comm.rank, comm.size)
    from_left = codes.copy() if hasattr(codes, "copy") else codes.clone()
    sendrecv(codes, right, from_left, left, tag=1, group=group)
    from_right = from_left
    if comm.size > 2:
        from_right = from_left.copy() if hasattr(from_left, "copy") else from_left.clone()
        sendrecv(codes, left, from_right, right, tag=2, group=group)
    _check_finite(comm, [(comm.rank, codes), (left, from_left), (right, from_right)])
    mine = kernels.dequantize_minmax_uint8(codes)
    if comm.size == 2:
        got = kernels.dequantize_minmax_uint8(from_left)
        return mine, got, got
    return (mine, kernels.dequantize_minmax_uint8(from_left),
            kernels.dequantize_minmax_uint8(from_right))


def _check_finite(comm: Any, received: list) -> None:
    from .. import kernels
    bad = sorted({r for r, codes in received if not kernels.all_chunks_finite(codes)})
    if bad:
        error = NonFiniteError(f"{where('compressed_ring_exchange', comm.rank)}: the tensor of "
                               f"ring rank(s) {bad} is not finite (NaN or Inf); nothing was "
                               f"returned")
        error.ranks = bad
        raise error
