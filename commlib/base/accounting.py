"""Per-process byte counters of everything commlib hands to MPI.

For each operation name: ``calls``; ``bytes``, the size of the send buffer this rank gave
MPI; and ``bus_bytes``, what this rank puts on the wire under the bandwidth-optimal
algorithm, with the factors of nccl-tests (n ranks in the group, B the buffer):

=================  ==============================
allreduce          2 (n - 1) / n * B
reduce_scatter     (n - 1) / n * B (B the full input)
alltoall(_v)       (n - 1) / n * B
gather             B (this rank's part)
scatter            (n - 1) / n * B (B the source's whole buffer; 0 on other ranks)
allgather(_v)      (n - 1) * B (B this rank's part)
broadcast, reduce  B
send, recv         B (counted on the sender; recv counts bytes, no bus bytes)
sendrecv           B (what this rank sends)
=================  ==============================

Compressed and hierarchical collectives count the buffers they really hand to MPI, under
the names of the MPI-level operations they are made of.

``seconds`` is the wall time this rank spent in the operation: inside MPI for blocking
calls, from the start until ``wait()``/``is_completed()`` saw it complete for asynchronous
ones (``async_op=True``); a hierarchical allreduce is timed as one ``allreduce``.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
#: op -> [calls, bytes, bus_bytes, seconds of the calls counted by record_timed]
_counters: dict[str, list[float]] = {}
#: op -> seconds added by timed() (asynchronous operations, the shared-memory tier...)
_seconds: dict[str, float] = {}
#: the running :class:`commlib.services.timeline.Timeline`, or ``None`` (set by
#: commlib.services.timeline)
tracer: Any = None


def _allreduce(nbytes: int, n: int) -> int:
    return 2 * (n - 1) * nbytes // n if n else 0


def _scatter(nbytes: int, n: int) -> int:
    return (n - 1) * nbytes // n if n else 0


def _gather(nbytes: int, n: int) -> int:
    return (n - 1) * nbytes


def _whole(nbytes: int, n: int) -> int:
    return nbytes if n > 1 else 0


def _none(nbytes: int, n: int) -> int:
    return 0


BUS_FACTOR: dict[str, Callable[[int, int], int]] = {
    "allreduce": _allreduce,
    "reduce_scatter": _scatter,
    "alltoall": _scatter,
    "alltoall_v": _scatter,
    "gather": _whole,
    "scatter": _scatter,
    "allgather": _gather,
    "allgather_v": _gather,
    "broadcast": _whole,
    "reduce": _whole,
    "send": _whole,
    "recv": _none,
    "sendrecv": _whole,
    "barrier": _none,
}


def record(op: str, nbytes: int, group_size: int) -> None:
    """Count one call of ``op`` that handed ``nbytes`` to MPI in a group of ``group_size``."""
    bus = BUS_FACTOR[op](nbytes, group_size)
    with _lock:
        c = _counters.get(op)
        if c is None:
            _counters[op] = [1, nbytes, bus, 0.0]
        else:
            c[0] += 1
            c[1] += nbytes
            c[2] += bus


def timed(op: str, t0: float, t1: float, comm: Any, what: Any, seq: int) -> None:
    """Add ``t1 - t0`` seconds (``time.perf_counter()``) to ``op``'s time, and an event
    to the timeline when one runs. ``comm``: the communicator; ``what``: the buffer."""
    with _lock:
        _seconds[op] = _seconds.get(op, 0.0) + (t1 - t0)
    if tracer is not None:
        tracer.collective(op, t0, t1, comm, what, seq)


def record_timed(op: str, nbytes: int, t0: float, t1: float, comm: Any, what: Any) -> None:
    """:func:`record` and :func:`timed` of one blocking call on ``comm`` (its size is the
    group size), under one lock: the hot path of small collectives (the same counters;
    the call's seconds kept beside its counts, so one dict lookup)."""
    bus = BUS_FACTOR[op](nbytes, comm.size)
    _lock.acquire()  # not ``with``: its __exit__ call costs as much as the counting
    c = _counters.get(op)
    if c is None:
        _counters[op] = [1, nbytes, bus, t1 - t0]
    else:
        c[0] += 1
        c[1] += nbytes
        c[2] += bus
        c[3] += t1 - t0
    _lock.release()  # nothing above raises (a dict lookup, int and float sums)
    if tracer is not None:
        tracer.collective(op, t0, t1, comm, what, comm.seq)


def stats(reset: bool = False) -> dict[str, dict[str, Any]]:
    """This rank's counters: ``{op: {"calls": int, "bytes": int, "bus_bytes": int,
    "seconds": float}}``.

    With ``reset=True`` the counters are cleared after they are read (atomically, so no call
    is lost between the read and the reset). Counts are local to the calling rank.
    """
    with _lock:
        out = {op: {"calls": c[0], "bytes": c[1], "bus_bytes": c[2],
                    "seconds": c[3] + _seconds.get(op, 0.0)}
               for op, c in _counters.items()}
        if reset:
            _counters.clear()
            _seconds.clear()
    return out


def total(snapshot: dict[str, dict[str, int]], field: str = "bus_bytes") -> int:
    """Sum of one field over all operations of a :func:`stats` snapshot."""
    return sum(v[field] for v in snapshot.values())
