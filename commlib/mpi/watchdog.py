"""Deadlines for blocking MPI calls.

MPI never times out: a rank whose peer is gone waits forever. Before a blocking call a
thread arms the watchdog with a deadline and a description of the call; a daemon thread
checks the armed deadlines and, when one passes, prints what was pending and aborts the
whole job through ``MPI_Abort`` so that ``mpiexec`` exits non-zero and no rank is left
hanging. Arming and disarming is a dict store and delete: the cost per call stays at a
fraction of a microsecond, and the blocking call itself is MPI's own.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from . import shm
from .shutdown import write_stderr

# Distinct from timeout(1)'s 124, so a watchdog abort and an outer timeout read differently.
ABORT_EXIT_CODE = 70
# Seconds between printing the reason for an abort and calling MPI_Abort.
ABORT_GRACE_S = 1.0
#: Called by every watchdog thread on each tick with ``(armed, now)``, after the deadlines
#: (commlib.core.exits watches for ranks that left while this one waits for them).
POLLERS: list[Callable[[dict, float], None]] = []
#: Every watchdog alive (:func:`postpone`).
_ALL: weakref.WeakSet[Watchdog] = weakref.WeakSet()


class Watchdog:
    """A daemon thread watching ``armed``: thread id -> ``(deadline, what)``, written by
    :meth:`commlib.core.communicator.Communicator.arm` around every blocking call (a dict store,
    so it costs next to nothing). ``on_expiry(what)`` runs when a deadline passes."""

    def __init__(self, on_expiry: Callable[[Any], None], poll_s: float = 0.25) -> None:
        self._on_expiry = on_expiry
        self._poll_s = poll_s
        # thread id -> (deadline, what): written by every blocking call, read by the thread
        self.armed: dict[int, tuple[float, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="commlib-watchdog", daemon=True)
        self._thread.start()
        _ALL.add(self)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            now = time.monotonic()
            expired = self._expired(now)
            if expired is not None:
                self._on_expiry(expired[0])
                return
            for poll in POLLERS:
                try:
                    poll(self.armed, now)
                except Exception as exc:  # noqa: BLE001 - the deadlines must stay watched
                    write_stderr(f"[commlib] watchdog: {poll.__qualname__} failed: {exc!r}")

    def _expired(self, now: float) -> tuple[Any] | None:
        """``(what,)`` of a passed deadline, else None. A function of its own, so that no
        entry stays referenced between ticks: an entry's ``what`` holds the call's buffers
        (a loop variable of ``_run`` kept the last one seen, and so the user's tensor,
        alive until the next entry came along: tests/test_buffers_cache.py saw it)."""
        for deadline, what in list(self.armed.values()):
            if now > deadline:
                return (what,)
        return None


def postpone(seconds: float) -> None:
    """Move the calling thread's armed deadline (on every watchdog) to at least ``seconds``
    from now; nothing where it has none. For a step inside a blocking call that bounds
    itself and may take longer than the call's own deadline allows: the attempts of a
    fault-tolerant communicator creation, each with its limit
    (:func:`commlib.fault.helper_thread.create_limit`), inside the collective that needs the
    communicator (a shared-memory window's first use builds several), which must not be
    aborted while an attempt it would retry still runs."""
    tid = threading.get_ident()
    until = time.monotonic() + float(seconds)
    for dog in list(_ALL):
        entry = dog.armed.get(tid)
        if entry is not None and entry[0] < until:
            dog.armed[tid] = (until, entry[1])


def abort_job(message: str, exit_code: int = ABORT_EXIT_CODE) -> None:
    """Print ``message`` on the process's real standard error (file descriptor 2, whatever
    ``sys.stderr`` is at the moment) and end every rank of the job, from any thread. The
    job's MPICH shared-memory segments are released first (:mod:`commlib.mpi.shm`)."""
    write_stderr(message)
    shm.release()
    # The launcher forwards our stderr through a pipe, and MPI_Abort makes it tear the job
    # down at once; without a moment's grace the diagnostic above is sometimes lost.
    from . import launch
    launch.abort(exit_code)  # a store-backed world (torchrun, srun...): the others leave too
    time.sleep(ABORT_GRACE_S)
    if launch.current() is not None:
        # The others follow the store; MPI_Abort would only wait, holding the GIL, for the
        # answer of this process's PMI server thread (Intel MPI), or return (MPICH).
        os._exit(exit_code)
    try:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.COMM_WORLD.Abort(exit_code)
    finally:
        # Without MPI (or if Abort returned), leave anyway: mpiexec reaps the other ranks.
        os._exit(exit_code)
