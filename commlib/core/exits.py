"""How a rank leaves an MPI job: never alone, never silently, never leaving a hang behind.

Armed by ``import commlib`` under an MPI launcher with more than one rank (see
:func:`commlib.mpi.mpi_env.launcher_world`; :func:`commlib.init` arms it too), before any user
code can fail:

* **An uncaught exception** aborts the whole job (``COMMLIB_ABORT_ON_EXCEPTION``, read when
  the exception happens): the rank and the traceback are written to the process's real
  standard error (file descriptor 2), so they survive a ``sys.stderr`` that someone swapped
  out (torch's ``_distributed_excepthook`` points it at a ``StringIO`` around our hook),
  then ``MPI_Abort`` ends every rank. Before ``commlib.init()`` too: the others may be
  waiting in torch's rendezvous, where nothing would ever end them.
* **Leaving the program** (the script ends, ``sys.exit``, an exception with the abort
  disabled) goes through an agreement before Python finalizes MPI (whose ``MPI_Finalize``
  waits for every other rank, forever if they wait for us). The rank sends its exit status
  to every other rank, then waits in a nonblocking barrier on a communicator of its own
  (a ``Dup`` of ``COMM_WORLD`` made at arming) for all of them to leave too:

  - all ranks leave: ``MPI_Finalize`` as before, the job's status is the ranks' own;
    ranks may end any time apart while nobody waits for them (one rank still saving a
    checkpoint is fine);
  - a rank left with a **non-zero status** and the others did not leave within
    ``COMMLIB_EXIT_WINDOW`` seconds (default 10): it aborts the job with its status;
  - a rank that **waits in a collective** (any call under the watchdog) of a group that
    contains a rank which has left aborts the job after ``COMMLIB_EXIT_WINDOW`` seconds
    (the window covers a collective the leaving rank finished just before leaving while
    this rank completes it), with status 72 (:data:`LEFT_ALONE_EXIT_CODE`) when the rank
    left with status 0. Detected by the watchdog thread, which probes for exit messages
    every 0.25 s (needs ``MPI_THREAD_MULTIPLE``, mpi4py's default);
  - otherwise a rank waits at most ``COMMLIB_TIMEOUT``, as in any blocking call.

  The exit status is known when the rank left through ``sys.exit`` (recorded by a thin
  wrapper around it) or an uncaught exception (status 1); a script that ends, or raises
  ``SystemExit`` itself, counts as status 0.
* **Fault-tolerant mode** (``COMMLIB_FAULT_TOLERANT=1``, see :mod:`commlib.fault.fault_tolerance`):
  a rank that leaves counts as dead for the survivors instead of ending the job. An uncaught
  exception ends only its rank (status 1, traceback printed); a waiting rank never aborts
  for a rank that left: its collectives raise :class:`~commlib.base.errors.PeerFailure`
  :data:`LEFT_GRACE_S` seconds after the leaver's exit message (or once the launcher reports
  it dead), and the survivors' agreement counts it dead at once. At exit a rank sends its exit message to the living
  (no collective: nothing may be sent to a dead rank, see :mod:`commlib.fault.fault_tolerance`),
  waits (status 0 only) up to ``COMMLIB_EXIT_WINDOW`` seconds for them to leave too, so
  that none is left waiting for messages of a collective it finished, and then leaves through
  ``os._exit`` with its status after flushing ``sys.stdout``/``sys.stderr`` and ``logging``:
  never ``MPI_Finalize``, which waits forever for a dead peer. ``atexit`` handlers registered
  before commlib was imported do not run in this mode.
* The MPI library's **shared-memory segments** lose their names in ``/dev/shm`` once every
  rank of the node maps them (:mod:`commlib.mpi.shm`), so that no exit path, a rank killed
  included, can leave them behind; every abort path releases whatever was mapped since.
"""
from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Any

from mpi4py import MPI

from ..base.options import options
from ..fault.ft_backend import iprobe_any, isend, sent
from ..mpi import shm, shutdown
from ..mpi.mpi_env import launcher_world
from ..mpi.watchdog import POLLERS, abort_job
from .communicator import describe_pending

#: Tag of the exit messages on the exit communicator (nothing else uses that communicator).
EXIT_TAG = 1
#: The job's exit status when a rank that left with status 0 is still awaited by a peer.
LEFT_ALONE_EXIT_CODE = 72
#: Seconds between tests of the exit barrier.
POLL_S = 0.002


class _Exits:
    """The exit communicator and what this rank learned of the others' exits."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()  # still known once the communicator is freed
        self.lock = threading.Lock()
        self.closed = False  # the main thread owns the communicator (at exit)
        self.left: dict[int, tuple[int, str, float]] = {}  # rank -> (status, how, seen at)
        self.sends: list[MPI.Request] | None = None  # this rank's exit messages, once sent
        self.first_seen: dict[int, tuple[Any, float]] = {}  # thread -> (pending, since)

    def drain(self) -> None:
        """Receive the exit messages that have arrived (caller holds the lock or owns the
        communicator)."""
        status = MPI.Status()
        while iprobe_any(self.comm, EXIT_TAG, status):  # ULFM: failures acknowledged
            source = status.Get_source()
            code, how = self.comm.recv(source=source, tag=EXIT_TAG)
            self.left[source] = (code, how, time.monotonic())


_state: _Exits | None = None
_exit_status: tuple[int, str] | None = None  # (status, how) once known
_real_exit: Any = None
_hook_installed = False
_lock = threading.Lock()


def armed() -> bool:
    """Whether the exit agreement is in place (a job of more than one rank)."""
    return _state is not None


def arm(collective: bool = True) -> None:
    """Install the exception hook and the ``sys.exit`` wrapper; with ``collective`` (every
    rank of ``COMM_WORLD`` calls it, as ``import commlib`` does under a launcher) also make
    the exit communicator, release the shared-memory segments' names and register the exit
    agreement. Idempotent; nothing in a world of one process."""
    global _state, _real_exit, _hook_installed
    with _lock:
        if not _hook_installed:
            sys.excepthook = _hook(sys.excepthook)
            _real_exit = sys.exit
            sys.exit = _sys_exit
            _hook_installed = True
        if not collective or _state is not None or not MPI.Is_initialized() or \
                MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
            return
        comm = MPI.COMM_WORLD.Dup()
        shm.release_node(comm)  # the segments every rank of the node maps lose their names
        _state = _Exits(comm)
        from ..fault import fault_tolerance
        fault_tolerance.SOURCES.append(_left_long_ago)
        if MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
            POLLERS.append(_poll)
        shutdown.at_final(_agree)


def arm_at_import() -> None:
    """``import commlib``: :func:`arm` under an MPI launcher with more than one rank (read
    from the environment, :func:`commlib.mpi.mpi_env.launcher_world`); in a world of one
    process only release its own shared-memory segment (nobody else maps it)."""
    if (launcher_world() or (0, 1))[1] > 1:
        arm()
    elif MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() == 1:
        shm.release()


def leave_alone() -> None:
    """Last step at exit of a process spawned into a fault-tolerant job
    (``commlib.primitives.ft``, for ``ft.joined``): its own ``MPI_COMM_WORLD`` holds no
    other rank to agree with, and ``MPI_Finalize`` would wait for every process it is
    connected to (Open MPI's dynamic-process disconnect spins forever where one died), so
    it leaves as the survivors do: flush, then ``os._exit`` with its status (0; what
    ``sys.exit`` gave; 1 after an uncaught exception)."""
    status = _exit_status[0] if _exit_status is not None else 0
    _flush_and_exit(int(status))


def _flush_and_exit(status: int) -> None:
    """Flush ``sys.stdout``/``sys.stderr`` and ``logging``, release the shared-memory
    segments' names and leave through ``os._exit(status)``: never ``MPI_Finalize``."""
    import logging
    import os
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
    try:
        logging.shutdown()
    except Exception:  # noqa: BLE001
        pass
    shm.release()
    os._exit(status % 256)


def record_exit(status: int, how: str) -> None:
    """Remember how this rank is leaving (for the exit agreement's messages)."""
    global _exit_status
    _exit_status = (status, how)


def leaving() -> bool:
    """Whether this rank is on its way out or handling an exception: it called
    ``sys.exit`` (in the main thread), announced its exit, or an exception is being handled
    by the calling thread (a framework's teardown inside ``except``). A collective started
    now may never be joined by the others (they are still training): layers that would free
    something collectively (``MPI_Win_free``) leave it to the end of the process instead."""
    if _exit_status is not None or sys.exc_info()[0] is not None:
        return True
    ex = _state
    return ex is not None and ex.sends is not None


def announce_exit(status: int | None = None, how: str | None = None) -> None:
    """Tell every other rank now that this rank is leaving the program (``status``/``how``
    default to what :func:`record_exit` recorded): from here on it takes part only in the
    collectives that every rank runs on its way out (the runner's end-of-script agreement),
    so a peer that waits :data:`COMMLIB_EXIT_WINDOW` seconds in any collective of a group
    holding it aborts the job instead of waiting ``COMMLIB_TIMEOUT``. The exit agreement
    later sends nothing more. Idempotent; nothing in fault-tolerant mode (where a rank that
    left counts as dead) or when the agreement is not armed."""
    ex = _state
    if ex is None or options.fault_tolerant or MPI.Is_finalized():
        return
    recorded = _exit_status or (0, "its script ended, or raised SystemExit")
    status = recorded[0] if status is None else status
    how = recorded[1] if how is None else how
    with ex.lock:
        if ex.closed or ex.sends is not None:
            return
        me, n = ex.comm.Get_rank(), ex.comm.Get_size()
        ex.sends = [ex.comm.isend((status, how), dest=r, tag=EXIT_TAG)
                    for r in range(n) if r != me]


def _sys_exit(arg: Any = None) -> None:
    if threading.current_thread() is threading.main_thread():
        code = 0 if arg is None else arg if isinstance(arg, int) else 1
        text = repr(arg) if arg is not None else ""
        record_exit(code, f"sys.exit({text[:60]})")
    _real_exit(arg)


def _rank() -> int:
    try:
        if MPI.Is_initialized() and not MPI.Is_finalized():
            return MPI.COMM_WORLD.Get_rank()
    except Exception:  # noqa: BLE001
        pass
    return (launcher_world() or (0, 1))[0]


def _hook(previous: Any) -> Any:
    def excepthook(exc_type: type, exc: BaseException, tb: Any) -> None:
        if issubclass(exc_type, KeyboardInterrupt) or not options.abort_on_exception or \
                options.fault_tolerant:
            record_exit(1, f"uncaught {exc_type.__name__}, status 1")
            previous(exc_type, exc, tb)
            return
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        abort_job(f"[commlib] rank {_rank()}: uncaught exception; aborting the job "
                  f"(COMMLIB_ABORT_ON_EXCEPTION=0 disables this)\n{text}", exit_code=1)

    excepthook.previous = previous  # type: ignore[attr-defined]
    return excepthook


def _job_status(status: int) -> int:
    """The status to abort with for a rank that left with ``status`` (as the shell sees
    it, 0-255; 0 becomes :data:`LEFT_ALONE_EXIT_CODE`: the job did not end well)."""
    return status % 256 or LEFT_ALONE_EXIT_CODE


def _describe(rank: int, how: str) -> str:
    return f"rank {rank} left the program ({how})"


def _poll(armed: dict, now: float) -> None:
    """Watchdog thread, every tick: learn of ranks that left; abort when a blocking call
    of this rank has waited ``COMMLIB_EXIT_WINDOW`` seconds on a group holding one."""
    ex = _state
    if ex is None:
        return
    with ex.lock:
        if not ex.closed and not MPI.Is_finalized():
            ex.drain()
    if not ex.left or options.fault_tolerant:
        return
    window = float(options.exit_window)
    for tid, (_, pending) in list(armed.items()):
        comm = pending[3] if isinstance(pending, tuple) and len(pending) == 4 else None
        gone = [r for r in getattr(comm, "world_ranks", ()) if r in ex.left]
        if not gone:
            ex.first_seen.pop(tid, None)
            continue
        seen = ex.first_seen.get(tid)
        if seen is None or seen[0] is not pending:
            ex.first_seen[tid] = (pending, now)
            continue
        if now - seen[1] < window:
            continue
        status, how, _ = ex.left[gone[0]]
        abort_job(f"[commlib] rank {ex.rank}: {_describe(gone[0], how)}, but "
                  f"this rank still waits for it after {window:g} s (COMMLIB_EXIT_WINDOW) "
                  f"in {describe_pending(pending)}; a rank that left cannot take part any "
                  f"more: aborting the job",
                  exit_code=_job_status(status))


def _agree() -> None:
    """At exit (main thread, after commlib's threads stopped, before MPI_Finalize): tell
    every rank, and wait for all of them to leave too (see the module docstring)."""
    ex = _state
    if ex is None or MPI.Is_finalized():
        return
    with ex.lock:
        ex.closed = True
    comm = ex.comm
    me, n = comm.Get_rank(), comm.Get_size()
    status, how = _exit_status or (0, "its script ended, or raised SystemExit")
    if options.fault_tolerant:
        _leave(ex, status, how)
    sends = ex.sends if ex.sends is not None else \
        [comm.isend((status, how), dest=r, tag=EXIT_TAG) for r in range(n) if r != me]
    barrier = comm.Ibarrier()
    limit, name = ((float(options.exit_window), "COMMLIB_EXIT_WINDOW") if status else
                   (float(options.timeout), "COMMLIB_TIMEOUT"))
    start = time.monotonic()
    while not barrier.Test():
        ex.drain()
        if time.monotonic() - start > limit:
            missing = [r for r in range(n) if r != me and r not in ex.left]
            abort_job(f"[commlib] rank {me}: {_describe(me, how)}, but rank(s) {missing} "
                      f"are still running after {limit:g} s ({name}) and would wait for it: "
                      f"aborting the job",
                      exit_code=_job_status(status))
        time.sleep(POLL_S)
    for r in range(n):
        if r != me and r not in ex.left:
            code, text = comm.recv(source=r, tag=EXIT_TAG)
            ex.left[r] = (code, text, time.monotonic())
    MPI.Request.Waitall(sends)
    comm.Free()


def all_ended_normally() -> bool:
    """After the exit agreement (an :func:`commlib.mpi.shutdown.at_final` step registered
    after it): whether every rank of the job, this one included, ended with status 0, so
    that a collective every rank makes on its way out (freeing what they made together)
    is safe; False before the agreement, in a world of one and in fault-tolerant mode."""
    ex = _state
    if ex is None or not ex.closed or options.fault_tolerant:
        return False
    if _exit_status is not None and _exit_status[0] != 0:
        return False
    n = MPI.COMM_WORLD.Get_size()
    return len(ex.left) == n - 1 and all(code == 0 for code, _, _ in ex.left.values())


def left_ranks() -> frozenset[int]:
    """World ranks that sent their exit message (they left, or are leaving, the program)."""
    ex = _state
    if ex is None:
        return frozenset()
    with ex.lock:
        if not ex.closed and not MPI.Is_finalized():
            ex.drain()
        return frozenset(ex.left)


#: Seconds a rank leaving with a non-zero status in fault-tolerant mode gives its exit
#: messages to get out.
SEND_GRACE_S = 0.2
#: Fault-tolerant mode: seconds after its exit message from which a rank that left counts
#: as dead for the survivors' collectives (until then they may still complete a collective
#: it finished before leaving); the agreement counts it dead at once.
LEFT_GRACE_S = 1.0


def _left_long_ago() -> list[int]:
    """A failure detector (:data:`commlib.fault.fault_tolerance.SOURCES`): ranks whose exit
    message came :data:`LEFT_GRACE_S` seconds ago or more (fault-tolerant mode only)."""
    ex = _state
    if ex is None or not options.fault_tolerant:
        return []
    left_ranks()
    now = time.monotonic()
    return [r for r, (_, _, seen) in list(ex.left.items()) if now - seen >= LEFT_GRACE_S]


def _leave_store(dead: frozenset) -> None:
    """In a store-backed world (:mod:`commlib.mpi.launch`), what its ``atexit`` handler would do
    (``os._exit`` skips it): tell the store this rank left; the rank hosting the store
    waits there until every rank has left. Dead ranks never leave, so the survivors count
    them as left (:meth:`commlib.mpi.launch.space.StoreSpace.leave_for`)."""
    from ..mpi import launch
    world = launch.current()
    if world is None:
        return
    try:
        world.space.leave_for(r for r in set(dead) | set(world.dead) if r >= 0)
        world.leave()
    except Exception:  # noqa: BLE001 - the store's host may be gone: leave anyway
        pass


def _leave(ex: _Exits, status: int, how: str) -> None:
    """Fault-tolerant mode's exit (see the module docstring): never returns."""
    from ..fault import fault_tolerance
    comm = ex.comm
    me, n = comm.Get_rank(), comm.Get_size()
    gone = fault_tolerance.dead_in_world()
    # Messages to the living only, and no collective: nothing may be sent to a dead rank
    # (see commlib.fault.fault_tolerance).
    sends = [isend(comm, (status, how), r, EXIT_TAG) for r in range(n)
             if r != me and r not in gone]
    start = time.monotonic()
    limit = float(options.exit_window) if status == 0 else SEND_GRACE_S
    while time.monotonic() - start < limit:
        ex.drain()
        gone = fault_tolerance.dead_in_world()
        if status != 0 and all(sent(s) for s in sends):
            break
        if all(r == me or r in ex.left or r in gone for r in range(n)):
            break  # everyone alive has left too: nobody can wait for this rank
        time.sleep(POLL_S)
    _leave_store(fault_tolerance.dead_in_world())
    _flush_and_exit(status)
