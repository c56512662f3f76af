"""Interruptible waits of fault-tolerant communicators (:mod:`commlib.fault.fault_tolerance`):
each operation starts nonblocking (:func:`_nonblocking`, :func:`_blocking`) and its request
is an :class:`FTRequest`, whose ``Wait`` hands it to a per-thread waiter blocked in
``MPI_Wait`` and returns when the request completes or raises :class:`PeerFailure` when a
peer of the job died (:func:`failure`); requests given up on are kept for good
(:data:`ABANDONED`). The communicator's side of it, which deaths concern it, is
:class:`_FTCommBase`."""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from ..base.errors import PeerFailure
from .failure_detection import Watcher
from .ft_backend import backend as _backend

#: Requests given up on, with their buffers and communicators: kept for good (see
#: :mod:`commlib.fault.fault_tolerance`; also those that ended with a ULFM error: a
#: revoked collective's late messages).
ABANDONED: list[Any] = []
#: Seconds a wait whose operation ended with a failure error (ULFM) waits for the detector
#: to name the dead before it raises :class:`PeerFailure` all the same.
DETECT_S = 5.0
#: Seconds a wait given up on waits for its waiter thread to come back once the
#: communicator is revoked (ULFM); a waiter that does not is left in ``MPI_Wait``.
INTERRUPT_S = 5.0
#: What happened to this process's waits on failures: ``errors`` (operations that ended
#: with a failure error, ULFM), ``interrupted`` (waits given up on whose waiter came back
#: after the communicator was revoked), ``left_in_mpi`` (waiters left in ``MPI_Wait``).
COUNTS = {"errors": 0, "interrupted": 0, "left_in_mpi": 0}

# -- requests ------------------------------------------------------------------------------

_local = threading.local()


class _Box:
    """One wait handed to a :class:`_Waiter`: ``event`` is set when the request completed
    (``done``; ``error``: the MPI error it ended with, ULFM) or when the watcher gives up
    on it (a peer died); ``back`` once the waiter returned from ``MPI_Wait``."""
    __slots__ = ("event", "back", "done", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.back = threading.Event()
        self.done = False
        self.error: BaseException | None = None


class _Waiter:
    """A thread that blocks in ``MPI_Wait`` for the thread that owns it. MPICH's
    ``MPI_Wait`` on one request progresses a large collective 2-3x faster than
    ``MPI_Waitany`` over it and a second request, or than any loop of ``MPI_Test``, even in
    C (16 MiB and 1 MiB ``MPI_Iallreduce`` at 4 ranks: 62 ms against 110-120 ms and 28
    against 106-108 ms), so the owner waits on an :class:`threading.Event` that either
    this thread or the watcher sets. A waiter whose request was given up on stays inside
    ``MPI_Wait`` for good (its request can never complete); its owner gets a new one."""

    def __init__(self) -> None:
        self.jobs: Any = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="commlib-ft-wait", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            req, status, box = self.jobs.get()
            try:
                req.Wait(status)
            except BaseException as exc:  # noqa: BLE001 - ULFM: ended with an error
                box.error = exc
            box.done = True
            box.back.set()
            box.event.set()


def _waiter() -> _Waiter:
    w = getattr(_local, "waiter", None)
    if w is None:
        w = _local.waiter = _Waiter()
    return w


class FTRequest:
    """A request of a fault-tolerant communicator: ``Wait``/``Test`` raise
    :class:`PeerFailure` (and give the request up, see :data:`ABANDONED`) once the
    communicator has failed."""

    __slots__ = ("req", "comm", "keep", "op")

    def __init__(self, req: Any, comm: _FTCommBase, keep: Any, op: str) -> None:
        self.req, self.comm, self.keep, self.op = req, comm, keep, op

    def Wait(self, status: Any = None) -> bool:
        if self.req == MPI.REQUEST_NULL:
            return True
        comm = self.comm
        w = comm.watcher
        if w.dead - comm.known_dead:
            self._give_up()
        if self.Test(status):
            return True
        box = _Box()
        key = id(box)
        with w.lock:
            w.waiting[key] = (box, comm)
            if w.dead - comm.known_dead:
                del w.waiting[key]
                self._give_up()
        waiter = _waiter()
        waiter.jobs.put((self.req, status, box))
        box.event.wait()
        with w.lock:
            w.waiting.pop(key, None)
        if not box.done:  # a peer died: interrupt the wait where the library can (ULFM)
            if _backend().interrupt(comm):
                box.back.wait(INTERRUPT_S)
            if box.back.is_set():
                COUNTS["interrupted"] += 1
            else:
                COUNTS["left_in_mpi"] += 1
                _local.waiter = None  # that one stays in MPI_Wait
                ABANDONED.append(waiter)
        if box.done and box.error is None:
            self.keep = None
            return True
        self._give_up(box.error)
        return False

    def Test(self, status: Any = None) -> bool:
        try:
            done = self.req.Test(status)
        except MPI.Exception as exc:
            if not _backend().failure_error(exc, self.comm):
                raise
            self._give_up(exc)
        if done:
            self.keep = None
            return True
        if self.comm.watcher.dead - self.comm.known_dead:
            self._give_up()
        return False

    def Cancel(self) -> None:
        self.req.Cancel()

    def _give_up(self, error: BaseException | None = None) -> None:
        ABANDONED.append((self.req, self.keep, self.comm))
        if error is not None and not _backend().failure_error(error, self.comm):
            raise error
        raise failure(self.comm, self.op, error)


def failure(comm: Any, op: str, error: BaseException | None = None) -> PeerFailure:
    """The :class:`PeerFailure` of ``op`` on ``comm`` (an :class:`FTComm`, or any object
    with ``failed``, ``failure(op)`` and ``watcher``). ``error``: the MPI error that
    reported it (ULFM): the communicator is revoked, so that every member's pending
    operations on it end too, and the detector gets up to :data:`DETECT_S` seconds to name
    the dead."""
    if error is not None:
        COUNTS["errors"] += 1
        if isinstance(comm, _FTCommBase):
            _backend().interrupt(comm)
        w = comm.watcher
        deadline = time.monotonic() + DETECT_S
        while not comm.failed and time.monotonic() < deadline:
            w.wait_change(w.dead, 0.05)
    return comm.failure(op)


def _start(comm: _FTCommBase, op: str, start: Callable, *args: Any, **kwargs: Any) -> Any:
    """``start(comm, *args, **kwargs)`` (an ``MPI_I...`` call): a failure it reports (ULFM:
    the communicator is revoked, a peer known dead) is :class:`PeerFailure`."""
    try:
        return start(comm, *args, **kwargs)
    except MPI.Exception as exc:
        if not _backend().failure_error(exc, comm):
            raise
        raise failure(comm, op, exc) from None


class _FTCommBase(MPI.Intracomm):
    """What a wait asks of its communicator: which deaths concern it (any of the job's
    since it was made) and the :class:`PeerFailure` they raise.
    :class:`~commlib.fault.fault_tolerance.FTComm` is its only subclass."""

    known_dead: frozenset
    watcher: Watcher
    name: str
    world_ranks: tuple[int, ...]

    # -- state --------------------------------------------------------------------------
    @property
    def failed(self) -> bool:
        return bool(self.watcher.dead - self.known_dead)

    def new_dead(self) -> list[int]:
        return sorted(self.watcher.dead - self.known_dead)

    def failure(self, op: str) -> PeerFailure:
        gone = self.new_dead()
        members = [r for r in gone if r in self.world_ranks]
        me = MPI.COMM_WORLD.Get_rank()
        what = (f"world rank(s) {members} of this communicator" if members else
                f"world rank(s) {gone} of the job (outside this communicator)" if gone else
                f"a process (the MPI library reported it within {DETECT_S:g} s; commlib's "
                f"detector has not named it yet)")
        return PeerFailure(
            f"commlib (rank {me}): {what} failed while this rank waited in MPI {op} on "
            f"the fault-tolerant communicator {self.name or '?'} (world ranks "
            f"{list(self.world_ranks)}); every survivor gets this error: shrink the group "
            f"(group.shrink()) or let commlib.elastic.run do it",
            failed=gone, world_ranks=self.world_ranks)

    def check(self, op: str) -> None:
        """Raise :class:`PeerFailure` if the communicator has failed."""
        if self.watcher.dead - self.known_dead:
            raise self.failure(op)


# -- operations ----------------------------------------------------------------------------

def _nonblocking(name: str) -> Callable:
    start = getattr(MPI.Intracomm, name)

    def method(self: _FTCommBase, *args: Any, **kwargs: Any) -> FTRequest:
        if self.watcher.dead - self.known_dead:  # never start anything towards the dead
            raise self.failure(name)
        return FTRequest(_start(self, name, start, *args, **kwargs), self, (args, kwargs),
                         name)

    method.__name__ = name
    return method


def _blocking(name: str, inonblocking: str) -> Callable:
    start = getattr(MPI.Intracomm, inonblocking)

    def method(self: _FTCommBase, *args: Any, **kwargs: Any) -> None:
        if self.watcher.dead - self.known_dead:
            raise self.failure(name)
        FTRequest(_start(self, name, start, *args, **kwargs), self, (args, kwargs),
                  name).Wait()

    method.__name__ = name
    return method
