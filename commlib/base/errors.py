"""Exceptions raised by commlib.

Every error names the argument (or collective), the rank that raised it and what was
expected, so that a message read from one rank's log is enough to find the fault.
"""
from __future__ import annotations


class CommError(RuntimeError):
    """A communication-level fault: ranks disagree about a collective, a peer sent
    something unexpected, or a group is used by a rank that is not in it."""


def where(op: str, rank: int) -> str:
    """Prefix for error messages: which collective on which rank."""
    return f"commlib.{op} (rank {rank})"


class NonFiniteError(CommError, FloatingPointError):
    """Non-finite values (NaN or Inf) where commlib will not spread them: weights that an
    algorithm would send into the other replicas. Raised on every rank that sees them,
    naming the ranks whose values are non-finite; nothing was updated."""


class PeerFailure(CommError):
    """A peer of a fault-tolerant group died (``COMMLIB_FAULT_TOLERANT=1``): raised on
    every survivor by the collective it was waiting in (or the next one it calls), within
    a bounded time of the death, instead of a hang. ``failed``: world ranks that died since
    the group was made; ``world_ranks``: the group's members. The buffers of that
    collective must not be reused (MPI may still write them); shrink the group
    (``group.shrink()``) and go on with the survivors, or let ``commlib.elastic.run`` do
    it."""

    def __init__(self, message: str, failed: list[int] | tuple[int, ...] = (),
                 world_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.failed = tuple(failed)
        self.world_ranks = tuple(world_ranks)
