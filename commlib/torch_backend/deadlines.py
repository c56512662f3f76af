"""The ``timeout`` of ``init_process_group``/``new_group`` on every wait of the backend.

Every operation of a process group waits at most the group's timeout (torch passes it to
the backend's creator; ``Work.wait(timeout)`` can shorten it for one handle), counted from
the moment the operation was called, as gloo does. A rank whose peers never join raises
``torch.distributed.DistBackendError`` (a ``RuntimeError``) saying ``Timed out`` and
naming the operation, the group and the timeout; whether to abort the job, retry on a new
group or carry on is the caller's decision. commlib's watchdog (``COMMLIB_TIMEOUT``, the
job-wide deadline of every MPI wait) stays the last resort: when the group's timeout is not
shorter than it, operations wait inside MPI as before and the watchdog ends the job at its
deadline (with the defaults, torch's 30 minutes and the watchdog's 30 minutes, that is what
happens); when it is shorter, the wait tests the MPI request in a loop (spinning, as MPI's
own wait does) until it completes or the deadline passes.

The state of a group after a timed-out collective: MPI cannot cancel a collective, so the
rank that gave up still has it posted, and its next collective on the group would be
matched by the peers with the abandoned one (wrong data, or a hang). So the group becomes
*unusable* on that rank: every later operation on it raises ``DistBackendError`` at once,
naming the collective that timed out, until the group is destroyed
(``destroy_process_group``; make a new group with the peers, or end the job). The
abandoned operation's buffers are kept alive for good (MPI may still write the result
into the caller's tensors if the peers arrive late: their contents are undefined). Ranks
that did not time out cannot know; their next collective on the group times out in turn
(the rank that gave up refuses to take part), rather than mixing up data. A timed-out
point-to-point receive is cancelled (the group stays usable); a send MPI cannot cancel is
abandoned like a collective.
"""
from __future__ import annotations

from datetime import timedelta
from time import monotonic
from typing import Any

import torch.distributed as dist

from ..base.options import options
from .convert import where

#: Operations given up on: MPI may still read or write their buffers, so they are never
#: freed (and their communicators are not freed while they are unfinished).
abandoned: list = []


def abandon(*pending: Any) -> None:
    """Give up on ``pending`` (:class:`commlib.Work` handles): kept alive here, and their
    communicators kept while they are unfinished (:meth:`commlib.Work.abandon`)."""
    for work in pending:
        abandoned.append(work)
        work.abandon()


def seconds(timeout: Any) -> float | None:
    """``timeout`` (a ``timedelta``, seconds, or ``None``/zero for none) in seconds."""
    if timeout is None:
        return None
    value = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return value if value > 0 else None


def poll(pending: Any, deadline: float) -> bool:
    """Test ``pending`` (a :class:`commlib.Work`) until it completes (True) or
    ``deadline`` (``time.monotonic()``) passes (False)."""
    is_completed = pending.is_completed
    while not is_completed():
        if monotonic() > deadline:
            return is_completed()
    return True


class GroupDeadlines:
    """The timeout of one process group and whether a timed-out collective made it
    unusable (see the module docstring)."""

    def __init__(self, timeout: Any, rank: int, describe: str) -> None:
        self.timeout_s = seconds(timeout) or float("inf")
        self.rank = rank
        self.describe = describe
        self.broken: str | None = None

    def set_timeout(self, timeout: Any) -> None:
        self.timeout_s = seconds(timeout) or float("inf")

    def deadline(self, timeout_s: float | None = None) -> float:
        """The deadline of an operation starting now."""
        return monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    def check(self, op: str) -> None:
        """Raise if a timed-out collective made the group unusable."""
        if self.broken is not None:
            raise dist.DistBackendError(
                f"{where(op, self.rank)}: this process group ({self.describe}) is unusable: "
                f"{self.broken} timed out on this rank earlier, and MPI cannot cancel a "
                f"collective, so the ranks no longer agree on which collective comes next; "
                f"destroy the group (destroy_process_group) and make a new one, or end the "
                f"job")

    def timed_out(self, op: str, timeout_s: float, collective: bool = True) -> Exception:
        what = (f"{where(op, self.rank)}: Timed out after {timeout_s:g} s waiting for the "
                f"other ranks of {self.describe} (the timeout of "
                f"init_process_group/new_group, or of Work.wait)")
        if collective:
            what += ("; the collective is abandoned and this process group is unusable "
                     "now: destroy it (destroy_process_group) and make a new one, or end "
                     "the job")
        return dist.DistBackendError(what)

    def wait(self, pending: Any, op: str, deadline: float, timeout_s: float | None = None,
             collective: bool = True) -> Any:
        """Complete ``pending`` by ``deadline`` and return its value, or raise (see the
        module docstring). Inside MPI when the deadline is not before the watchdog's."""
        if collective and self.broken is not None:
            abandon(pending)
            self.check(op)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if timeout_s >= options.timeout:
            return pending.wait()
        if poll(pending, deadline):
            return pending.wait()
        if collective:
            self.broken = f"{op} (timeout {timeout_s:g} s)"
        elif pending.cancel(0.1):
            raise self.timed_out(op, timeout_s, collective=False)
        abandon(pending)
        raise self.timed_out(op, timeout_s, collective)
