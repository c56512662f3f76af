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
import sys
import threading
import time
from typing import Any, Callable

# Distinct from timeout(1)'s 124, so a watchdog abort and an outer timeout read differently.
ABORT_EXIT_CODE = 70


class Watchdog:
    def __init__(self, timeout: float, on_expiry: Callable[[str], None]) -> None:
        self.timeout = float(timeout)
        self._on_expiry = on_expiry
        self._armed: dict[int, tuple[float, Any]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def arm(self, what: Any) -> None:
        """Start the clock for the calling thread's pending blocking call.

        ``what`` is any object whose ``str`` describes the call; it is formatted only on expiry.
        """
        self._armed[threading.get_ident()] = (time.monotonic() + self.timeout, what)
        if self._thread is None:
            self._start()

    def disarm(self) -> None:
        self._armed.pop(threading.get_ident(), None)

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="commlib-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, max(self.timeout / 20.0, 0.05))):
            now = time.monotonic()
            for deadline, what in list(self._armed.values()):
                if now > deadline:
                    self._on_expiry(str(what))
                    return


def abort_job(message: str, exit_code: int = ABORT_EXIT_CODE) -> None:
    """Print ``message`` and end every rank of the job, from any thread."""
    try:
        sys.stderr.write(message.rstrip("\n") + "\n")
        sys.stderr.flush()
    except Exception:
        pass
    try:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.COMM_WORLD.Abort(exit_code)
    finally:
        # Without MPI (or if Abort returned), leave anyway: mpiexec reaps the other ranks.
        os._exit(exit_code)
