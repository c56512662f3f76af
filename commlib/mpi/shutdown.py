"""Stop commlib's threads and requests before MPI is finalized, on every exit path.

mpi4py finalizes MPI from a ``Py_AtExit`` callback: after every ``atexit`` handler, after
module globals were cleared, with daemon threads left wherever they were. A commlib
thread still inside MPI at that moment (a background averaging round, a bucket exchange
on the communication thread) makes the process crash at exit ("corrupted double-linked
list", SIGSEGV, "terminate called without an active exception").

Whatever owns a thread or a pending request registers here, weakly (registration never
keeps an object alive): an object with a method ``stop_at_exit(deadline) -> bool`` that
stops its work by the ``time.monotonic()`` ``deadline`` and says whether nothing of it
is left running. One ``atexit`` handler, installed on the first registration (so after
mpi4py is imported: it would also run before an ``atexit`` handler of mpi4py's), stops
the live objects newest first when the interpreter exits: at the end of the script, on
``sys.exit`` and after an uncaught exception (with ``COMMLIB_ABORT_ON_EXCEPTION=1`` an
uncaught exception ends the job through ``MPI_Abort`` before any of this runs). Then the
steps given to :func:`at_final` run (the exit agreement with the other ranks of
:mod:`commlib.core.exits`), the last thing before mpi4py finalizes MPI.

Stopping is bounded: everything together gets :data:`EXIT_GRACE_S` seconds (at most
``COMMLIB_TIMEOUT``). Objects whose stop is collective (the background averager agrees
with its peers) give up when a peer is gone; if anything is still running at the
deadline, MPI cannot be finalized safely, so the process leaves at once with status
:data:`STUCK_EXIT_CODE` without finalizing MPI (which makes ``mpiexec`` end the other
ranks), after one line on stderr and releasing MPICH's shared-memory segments
(:mod:`commlib.mpi.shm`), instead of crashing inside or hanging in ``MPI_Finalize``.
"""
from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..base.options import options
from . import shm

#: Seconds that stopping everything at exit may take (bounded by ``COMMLIB_TIMEOUT`` too).
EXIT_GRACE_S = 10.0
#: Exit status of a process that could not stop its communication at exit.
STUCK_EXIT_CODE = 71
#: Each object gets at least this long, even once the common deadline has passed (an idle
#: thread stops in microseconds; this keeps one stuck object from hiding the others).
MIN_STOP_S = 0.5

_lock = threading.Lock()
_registered: list[weakref.ref] = []
_installed = False
_final: list[Callable[[], None]] = []


def register(obj: Any) -> None:
    """Stop ``obj`` (weakly referenced) at interpreter exit, before MPI is finalized, by
    calling ``obj.stop_at_exit(deadline)``. Registering an object twice is harmless."""
    with _lock:
        _registered[:] = [r for r in _registered if r() is not None]
        if any(r() is obj for r in _registered):
            return
        _registered.append(weakref.ref(obj))
        _install()


def at_final(step: Callable[[], None]) -> None:
    """Run ``step()`` at exit once every registered object has stopped, last thing before
    MPI is finalized (commlib.core.exits' agreement with the other ranks); once per step."""
    with _lock:
        if step not in _final:
            _final.append(step)
        _install()


def _install() -> None:
    global _installed
    if not _installed:
        atexit.register(_at_exit)
        _installed = True


def unregister(obj: Any) -> None:
    """Forget ``obj`` (e.g. once it was closed); unknown objects are ignored."""
    with _lock:
        _registered[:] = [r for r in _registered if r() is not None and r() is not obj]


def live() -> list[Any]:
    """The registered objects still alive, newest first."""
    with _lock:
        objs = [r() for r in reversed(_registered)]
    return [o for o in objs if o is not None]


def stop_all(grace_s: float | None = None) -> list[Any]:
    """Stop every registered object, newest first, within ``grace_s`` seconds in all
    (default: :data:`EXIT_GRACE_S`, at most ``COMMLIB_TIMEOUT``). Returns the objects that
    did not stop in time. Errors are printed, never raised."""
    if grace_s is None:
        grace_s = min(EXIT_GRACE_S, float(options.timeout))
    deadline = time.monotonic() + grace_s
    stuck = []
    for obj in live():
        try:
            if not obj.stop_at_exit(max(deadline, time.monotonic() + MIN_STOP_S)):
                stuck.append(obj)
        except BaseException as exc:  # noqa: BLE001 - nothing may escape at exit
            _note(f"stopping {obj!r} at exit failed: {type(exc).__name__}: {exc}")
    return stuck


def _at_exit() -> None:
    stuck = stop_all()
    if not stuck:
        # Free what only reference cycles keep alive (DDP wrappers, torch process groups
        # whose C++ threads abort the process, "terminate called without an active
        # exception", when they are destroyed during interpreter finalization instead:
        # 6 of 30 plain torchrun gloo jobs under load, none with this collection).
        gc.collect()
        for step in list(_final):
            step()
        return
    _note(f"{', '.join(repr(o) for o in stuck)} still running at exit (a peer is gone or "
          f"stuck); leaving without finalizing MPI (exit status {STUCK_EXIT_CODE})")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    shm.release()
    os._exit(STUCK_EXIT_CODE)


def write_stderr(text: str) -> None:
    """Write ``text`` (and a newline) to the process's real standard error, file descriptor
    2, after flushing ``sys.stderr``: a ``sys.stderr`` replaced by a buffer (torch's
    ``_distributed_excepthook`` does that around the hook that may abort the job) would
    lose it. Never raises."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.flush()
        except Exception:
            pass
    data = (text.rstrip("\n") + "\n").encode("utf-8", "replace")
    try:
        while data:
            data = data[os.write(2, data):]
    except OSError:
        pass


def _note(text: str) -> None:
    try:
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else 0
    except Exception:
        rank = 0
    write_stderr(f"[commlib] rank {rank}: {text}")
