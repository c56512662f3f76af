"""Ranks standing by (fault-tolerant mode): small messages to idle ranks, and their idle
wait, on the control communicator of :mod:`commlib.primitives.ft` (``MPI_COMM_WORLD``'s
ranks, every rank alive when it was made; never failed: only point-to-point messages to
the living travel on it).

What :mod:`commlib.elastic`'s spares use: a spare waits in :func:`wait_call` (a probe for
a message of tag :data:`STANDBY_TAG` every :data:`POLL_S` seconds, sleeping in between: no
MPI call spins, no collective is joined, no other rank's death interrupts it), the
trainers :func:`call` it (one message per rank called, never to a rank known dead) and
then bring it into their group with :func:`commlib.primitives.ft.assemble`.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from mpi4py import MPI

from ..base.errors import CommError, where
from ..core import exits
from ..fault import fault_tolerance
from ..fault.ft_backend import iprobe_any, isend, sent
from . import ft

#: Tag of the standby messages on the control communicator.
STANDBY_TAG = 23
#: Seconds between two probes of an idle rank (about 200 probes a second: a few
#: microseconds of CPU each).
POLL_S = 0.005


def _ctl() -> Any:
    ft.agreement()  # the control communicator exists (fault-tolerant mode)
    return ft._ctl


def gone() -> frozenset[int]:
    """World ranks dead or that left the program, as this rank knows them now."""
    return frozenset(fault_tolerance.dead()) | frozenset(exits.left_ranks())


def call(ranks: Iterable[int], message: Any) -> list[Any]:
    """Send ``message`` (picklable) to each world rank of ``ranks`` not known dead (not a
    collective: the caller alone); returns the send requests (see :func:`settle`)."""
    ctl = _ctl()
    dead = gone()
    me = ctl.Get_rank()
    return [isend(ctl, message, int(r), STANDBY_TAG) for r in ranks
            if int(r) not in dead and int(r) != me]


def settle(requests: list[Any], timeout: float) -> bool:
    """Wait (probing every :data:`POLL_S` s) until every send of :func:`call` is done or
    its destination is dead, at most ``timeout`` seconds; whether all were."""
    pending = [r for r in requests if r is not None]
    deadline = time.monotonic() + float(timeout)
    while pending:
        pending = [r for r in pending if not sent(r)]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    return not pending


def wait_call(give_up: Callable[[frozenset], str | None] | None = None,
              timeout: float | None = None) -> Any:
    """Wait idle for the next standby message to this rank and return it (its sender is
    not said: several ranks may send the same call). ``give_up(gone)``, asked at every
    probe with the ranks dead or left: a reason to stop waiting (then :class:`CommError`
    with it); ``timeout`` (default: none): seconds after which the same. No collective,
    and a death elsewhere does not end the wait."""
    ctl = _ctl()
    status = MPI.Status()
    start = time.monotonic()
    while True:
        if iprobe_any(ctl, STANDBY_TAG, status):
            return ctl.recv(source=status.Get_source(), tag=STANDBY_TAG)
        why = give_up(gone()) if give_up is not None else None
        if why is None and timeout is not None and time.monotonic() - start > timeout:
            why = f"no call within {timeout:g} s"
        if why:
            raise CommError(f"{where('standby', MPI.COMM_WORLD.Get_rank())}: stopped "
                            f"waiting: {why}")
        time.sleep(POLL_S)
