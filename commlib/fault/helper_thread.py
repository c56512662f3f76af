"""Blocking MPI calls with no nonblocking form (communicator creation, spawn, merge) on a
helper thread while the caller waits with failure detection (:func:`in_thread`): a death
raises :class:`PeerFailure` and leaves the thread inside MPI, a call that neither ends nor
fails in time raises :class:`CallTimedOut`; the thread works on its own copies of the MPI
groups and info objects it is handed (:func:`_own_handles`)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from ..base.errors import CommError
from ..base.options import options
from .failure_detection import POLL_S
from .ft_backend import backend as _backend
from .waits import ABANDONED, _FTCommBase, failure

#: Attempts at a communicator creation that each time out (:func:`create_limit`) before the
#: creator raises (the survivors' :func:`commlib.primitives.ft.shrink`, and a creation
#: derived from a communicator made after a failure under ULFM:
#: :meth:`commlib.fault.fault_tolerance.FTComm.Dup`).
CREATE_ATTEMPTS = 3


def create_limit() -> float:
    """Seconds one attempt at a communicator's creation may take: a quarter of
    ``COMMLIB_TIMEOUT``, at least 10 and at most 60 (a creation takes milliseconds; every
    member starts it within a round trip of the others)."""
    return min(float(options.timeout), max(10.0, min(60.0, float(options.timeout) / 4)))


class CallTimedOut(CommError):
    """A blocking MPI call on a helper thread (:func:`in_thread`) neither ended nor failed
    within its limit; the thread was left inside MPI."""


def _own_handles(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[Any]]:
    """``args`` with a copy of each MPI group and info object in it (for :func:`in_thread`'s
    helper thread alone, freed by that thread when the call returns), and the copies.

    A caller frees its group or info when the call ends for it (``finally: group.Free()``),
    and a call given up on (a peer died) has not ended for MPI: MPICH reads the group all
    through ``MPI_Comm_create_group`` (its rank mapping, in each round of the context id's
    allreduce). The survivors' creation (:mod:`commlib.primitives.ft`), given up on when a
    member died just after its own creation returned (a survivor killed as a spare joins),
    went on reading a freed group: the likely cause of the rare segfault of
    ``test_a_survivor_dies_while_a_spare_joins``. Measured on MPICH 5.0.2, 3 ranks, the
    creation given up on 1 ms in, the others entering up to 60 ms late, the caller freeing
    its group: the job aborted at MPICH's assertion ``(cdst) != MPI_UNDEFINED``
    (``allreduce_group.c``) in the first run; with these copies, 300 of 300 creations
    (about 100 per rank given up on while running)."""
    owned: list[Any] = []
    mine = []
    for a in args:
        if isinstance(a, (MPI.Group, MPI.Info)) and a not in (MPI.GROUP_NULL, MPI.INFO_NULL,
                                                                MPI.GROUP_EMPTY):
            a = a.Dup()
            owned.append(a)
        mine.append(a)
    return tuple(mine), owned


def in_thread(comm: Any, op: str, fn: Callable, *args: Any,
              limit_s: float | None = None) -> Any:
    """Run the blocking MPI call ``fn(*args)`` on a helper thread and wait for it with
    failure detection: ``comm`` (an :class:`FTComm`, or any object with ``failed``,
    ``failure(op)`` and ``watcher``) says when to give up; then raise its
    :class:`PeerFailure` and leave the thread inside MPI (see the module docstring; an
    :class:`FTComm` is revoked first where the library can, which ends the call). A
    failure the call itself reports (ULFM) is :class:`PeerFailure` too. A call that neither
    ends nor fails within ``COMMLIB_TIMEOUT`` raises :class:`CommError` (the watchdog does
    not see these calls; ``limit_s``: a shorter limit, for a caller that retries), a
    :class:`CallTimedOut`."""
    if comm.failed:
        raise comm.failure(op)
    done = threading.Event()
    out: list[Any] = []
    args, owned = _own_handles(args)

    def run() -> None:
        try:
            out.append((True, fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out.append((False, exc))
        finally:
            for handle in owned:  # (the call is over: nothing else uses them)
                handle.Free()
        done.set()

    thread = threading.Thread(target=run, name=f"commlib-ft-{op}", daemon=True)
    thread.start()
    seconds = float(options.timeout if limit_s is None else limit_s)
    limit = time.monotonic() + seconds
    while not done.wait(POLL_S):
        if time.monotonic() > limit and not done.is_set():
            ABANDONED.append((thread, args))
            what = "COMMLIB_TIMEOUT" if limit_s is None else "this attempt's limit"
            raise CallTimedOut(f"commlib (rank {MPI.COMM_WORLD.Get_rank()}): MPI {op} did "
                               f"not complete within {seconds:g} s ({what}) and no peer is "
                               f"known dead; giving it up")
        if comm.failed:
            ABANDONED.append((thread, args))
            if isinstance(comm, _FTCommBase):
                _backend().interrupt(comm)
            raise comm.failure(op)
    ok, value = out[0]
    if not ok:
        if _backend().failure_error(value, comm if isinstance(comm, _FTCommBase) else None):
            ABANDONED.append((thread, args))
            raise failure(comm, op, value) from None
        raise value
    return value
