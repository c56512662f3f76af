"""Fault-tolerant communicators: a dead peer becomes :class:`~commlib.base.errors.PeerFailure`
on every survivor, never a hang (``COMMLIB_FAULT_TOLERANT=1`` or
``commlib.init(fault_tolerant=True)``).

What follows was built on the MPICH wheel; what differs on other MPI libraries (Open MPI's
ULFM, Intel MPI's launcher) is in :mod:`commlib.fault.ft_backend`: there an operation can
complete *with an error* once a peer died (``MPI_ERR_PROC_FAILED``, ``MPI_ERR_REVOKED``),
which every wait, start and helper thread here turns into :class:`PeerFailure` (after the
detector names the dead, :data:`DETECT_S` at most), and a wait given up on is interrupted
(``MPI_Comm_revoke``) so that its waiter thread comes back instead of staying in MPI.

The MPICH wheel has no working ULFM (``MPIX_Comm_revoke``/``shrink``/``agree`` abort in
ch4), and no MPI operation ever completes with an error once a peer is dead: a blocking
``MPI_Allreduce`` waits forever. What works (``shared/notes/surviving-a-dead-rank.md``):

* **Failure detection.** ``MPIX_Comm_get_failed`` (through ctypes) reads the launcher's list
  of dead processes: hydra's ``PMI_dead_processes`` when ``mpiexec`` runs with
  ``-disable-auto-cleanup``, or the store-backed world of :mod:`commlib.mpi.launch`, which
  answers the same PMI key. A daemon thread (:class:`Watcher`) polls it every
  :data:`POLL_S` seconds (one PMI round trip, 0.2-0.5 ms); other detectors can be added to
  :data:`SOURCES` (all in :mod:`commlib.fault.failure_detection`).
* **Every wait interruptible.** Every operation of a fault-tolerant communicator
  (:class:`FTComm`, an ``mpi4py`` ``Intracomm`` subclass, so every primitive and algorithm
  uses it unchanged) is nonblocking: the blocking calls (``Allreduce``, ``Bcast``,
  ``Recv``...) start their ``I`` counterpart, and every request is an :class:`FTRequest`
  whose ``Wait`` hands the request to a waiter thread blocked in ``MPI_Wait`` (the fastest
  way MPICH has to drive a collective, see :class:`_Waiter`) and waits on an event that
  the waiter sets when the request completes, or the watcher when a peer dies; then the
  waiter stays inside ``MPI_Wait`` for good (one spinning thread per wait given up on).
* **Failure domain: the whole job.** A communicator is *failed* once any process of the job
  died that was not known dead when the communicator was made; its pending and later
  operations raise :class:`PeerFailure` (on every survivor, whatever group it waits on, so
  no survivor is left waiting for another that went into recovery), and
  :func:`commlib.primitives.ft.shrink` builds the survivors' communicator (with
  :mod:`commlib.fault.agreement`).
* **Nothing new towards the dead.** No operation starts on a failed communicator: with
  libfabric's ``tcp`` provider (``MPIR_CVAR_CH4_NETMOD=ofi``) a send that reaches a dead
  peer reconnects with a blocking ``connect()`` that never returns, and the survivor's whole
  progress engine hangs there (seen in 3 of 5 runs of an ``MPI_Ibarrier`` over a dead rank,
  with one proxy per rank and on the emulated cluster alike). An abandoned operation whose
  schedule later sends to the dead rank can do the same, so fault-tolerant mode needs UCX
  (the wheel's default netmod), which returns.
* **Abandoned operations.** A request given up on is kept, with its buffers and its
  communicator, for the rest of the process (:data:`ABANDONED`): MPI may still read or write
  them (mpi4py 4.1.2 does not hold the buffers of ``Iallreduce``, ``Ireduce``,
  ``Ireduce_scatter`` and ``Iallgatherv``; freeing them corrupted the survivors' next
  allreduce in 7 of 7 probe runs). Callers must not reuse the memory of a collective that
  raised :class:`PeerFailure` either (:mod:`commlib.elastic` rebuilds its buffers).
* **Communicator creation** (``Split``, ``Split_type``, ``Create_group``) has no
  nonblocking form: it runs on a helper thread while the caller waits with failure
  detection; on a failure the thread is left inside MPI (it spins there for the rest of the
  process). ``Dup`` is ``MPI_Comm_idup``; under Open MPI's ULFM the communicators made
  after a failure, and those derived from them, are built with
  ``MPI_Comm_create_from_group`` instead (:attr:`FTComm.key`; why:
  :mod:`commlib.fault.ft_backend`).

Survivors never call ``MPI_Finalize`` (it hangs once a peer is dead): in this mode the exit
path of :mod:`commlib.core.exits` leaves through ``os._exit`` after flushing.
"""
from __future__ import annotations

import pickle
import queue
import threading
import time
from collections.abc import Callable, Iterable
from functools import reduce as _fold
from typing import Any

import numpy as np
from mpi4py import MPI

from ..base.errors import CommError, PeerFailure
from ..base.options import options

# Detection (the watcher thread and its detectors) is commlib.fault.failure_detection's; these
# names are part of this module's API too.
from .failure_detection import (  # noqa: F401
    POLL_S,
    SOURCES,
    StoreDetector,
    Watcher,
    available,
    dead,
    dead_in_world,
    watcher,
)
from .ft_backend import backend as _backend

__all__ = ["ABANDONED", "FTComm", "FTRequest", "adopt", "failure", "in_thread", "POLL_S",
           "SOURCES", "StoreDetector", "Watcher", "available", "dead", "dead_in_world",
           "watcher"]

#: Requests given up on, with their buffers and communicators: kept for good (see above;
#: also those that ended with a ULFM error: a revoked collective's late messages).
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

    def __init__(self, req: Any, comm: FTComm, keep: Any, op: str) -> None:
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
        if isinstance(comm, FTComm):
            _backend().interrupt(comm)
        w = comm.watcher
        deadline = time.monotonic() + DETECT_S
        while not comm.failed and time.monotonic() < deadline:
            w.wait_change(w.dead, 0.05)
    return comm.failure(op)


def _start(comm: FTComm, op: str, start: Callable, *args: Any, **kwargs: Any) -> Any:
    """``start(comm, *args, **kwargs)`` (an ``MPI_I...`` call): a failure it reports (ULFM:
    the communicator is revoked, a peer known dead) is :class:`PeerFailure`."""
    try:
        return start(comm, *args, **kwargs)
    except MPI.Exception as exc:
        if not _backend().failure_error(exc, comm):
            raise
        raise failure(comm, op, exc) from None


# -- communicators -------------------------------------------------------------------------

def _nonblocking(name: str) -> Callable:
    start = getattr(MPI.Intracomm, name)

    def method(self: FTComm, *args: Any, **kwargs: Any) -> FTRequest:
        if self.watcher.dead - self.known_dead:  # never start anything towards the dead
            raise self.failure(name)
        return FTRequest(_start(self, name, start, *args, **kwargs), self, (args, kwargs),
                         name)

    method.__name__ = name
    return method


def _blocking(name: str, inonblocking: str) -> Callable:
    start = getattr(MPI.Intracomm, inonblocking)

    def method(self: FTComm, *args: Any, **kwargs: Any) -> None:
        if self.watcher.dead - self.known_dead:
            raise self.failure(name)
        FTRequest(_start(self, name, start, *args, **kwargs), self, (args, kwargs),
                  name).Wait()

    method.__name__ = name
    return method


_NONBLOCKING = ("Iallreduce", "Ibcast", "Ibarrier", "Iallgather", "Iallgatherv", "Ireduce",
                "Ireduce_scatter", "Ireduce_scatter_block", "Igather", "Igatherv",
                "Iscatter", "Iscatterv", "Ialltoall", "Ialltoallv", "Isend", "Irecv",
                "Issend")
_BLOCKING = ("Allreduce", "Bcast", "Barrier", "Allgather", "Allgatherv", "Reduce",
             "Reduce_scatter", "Reduce_scatter_block", "Gather", "Gatherv", "Scatter",
             "Scatterv", "Alltoall", "Alltoallv", "Send", "Ssend")


class FTComm(MPI.Intracomm):
    """An intracommunicator whose every operation is nonblocking and interrupted by a peer's
    death (see the module docstring). ``known_dead``: world ranks already dead when it was
    made; the communicator has failed once any other rank of the job is dead."""

    known_dead: frozenset = frozenset()
    watcher: Watcher
    #: The name its members know it by, the same on each and no other communicator's
    #: (the agreement's, for one made after a failure; its parent's and the call's for
    #: one derived from it); None: made by the library's allocator, as are those derived
    #: from it (see :attr:`commlib.fault.ft_backend.Backend.derive_by_create`).
    key: str | None = None

    def ft_init(self, known_dead: Iterable[int] | None = None, name: str = "",
                key: str | None = None) -> FTComm:
        self.watcher = w = watcher()
        self.known_dead = w.dead if known_dead is None else frozenset(known_dead)
        self.name = name
        self.key = key
        self._derived: dict[tuple[Any, ...], int] = {}
        group = self.Get_group()
        try:
            self.world_ranks = tuple(MPI.Group.Translate_ranks(
                group, list(range(group.Get_size())), w.base))
        finally:
            group.Free()
        self._creations = 0
        return self

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

    # -- communicator creation ----------------------------------------------------------
    def _create(self, group: Any, what: tuple[Any, ...]) -> FTComm:
        """The communicator of ``group`` (of this one), built by its members with the
        backend's :meth:`~commlib.fault.ft_backend.Backend.create` under a name derived
        from this one's :attr:`key` and ``what`` (the call, the same on every member), on
        a helper thread (:func:`in_thread`); only where :attr:`key` is set."""
        b = _backend()
        n = self._derived.get(what, 0)
        self._derived[what] = n + 1  # (members call creations in the same order)
        key = f"{self.key}/{'/'.join(map(str, what))}#{n}"
        new = in_thread(self, b.create_op, b.create, self, group, 0, key)
        return adopt(new, self.known_dead, self.name, key)

    def Dup(self, info: Any = None) -> FTComm:
        self.check("Comm_idup")
        if self.key is not None:  # (Open MPI after a failure: not through its allocator)
            group = self.Get_group()
            try:
                return self._create(group, ("dup",))
            finally:
                group.Free()
        new, req = _start(self, "Comm_idup", MPI.Intracomm.Idup,
                          *(() if info is None else (info,)))
        FTRequest(req, self, new, "Comm_idup").Wait()
        return adopt(new, self.known_dead, self.name)

    def Split(self, color: int = 0, key: int = 0) -> Any:
        pairs = self.allgather((int(color), int(key)))
        self._creations += 1
        if color == MPI.UNDEFINED:
            return MPI.COMM_NULL
        members = sorted((k, r) for r, (c, k) in enumerate(pairs) if c == color)
        group = self.Get_group().Incl([r for _, r in members])
        try:
            return self.Create_group(group, tag=self._creations)
        finally:
            group.Free()

    def Split_type(self, split_type: int, key: int = 0, info: Any = None) -> Any:
        if self.key is not None:  # (see Dup)
            if split_type != MPI.COMM_TYPE_SHARED:
                raise CommError(f"commlib (rank {MPI.COMM_WORLD.Get_rank()}): "
                                f"MPI_Comm_split_type of type {split_type} on the "
                                f"communicator {self.name} (made after a failure on "
                                f"{_backend().impl.describe()}) is not supported: only "
                                f"MPI_COMM_TYPE_SHARED")
            hosts = self.allgather(MPI.Get_processor_name())
            return self.Split(sorted(set(hosts)).index(hosts[self.Get_rank()]), key)
        args = (split_type, key) if info is None else (split_type, key, info)
        new = in_thread(self, "Comm_split_type", MPI.Intracomm.Split_type, self, *args)
        return new if new == MPI.COMM_NULL else adopt(new, self.known_dead, self.name)

    def Create_group(self, group: Any, tag: int = 0) -> FTComm:
        if self.key is not None:  # (see Dup)
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                              self.watcher.base)
            return self._create(group, ("group", tag, tuple(ranks)))
        new = in_thread(self, "Comm_create_group", MPI.Intracomm.Create_group, self, group,
                        tag)
        return adopt(new, self.known_dead, self.name)

    def Free(self) -> None:
        if self.failed:  # pending operations may still use it: keep it
            ABANDONED.append(self)
            return
        MPI.Intracomm.Free(self)

    # -- blocking operations with a status argument ---------------------------------------
    def Recv(self, buf: Any, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG,
             status: Any = None) -> None:
        self.check("Recv")
        FTRequest(_start(self, "Recv", MPI.Intracomm.Irecv, buf, source, tag), self, buf,
                  "Recv").Wait(status)

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = MPI.ANY_SOURCE, recvtag: int = MPI.ANY_TAG,
                 status: Any = None) -> None:
        # Not MPI_Isendrecv: MPICH 5.0.2 leaves its status' count at 0.
        self.check("Sendrecv")
        recv = _start(self, "Sendrecv", MPI.Intracomm.Irecv, recvbuf, source, recvtag)
        send = _start(self, "Sendrecv", MPI.Intracomm.Isend, sendbuf, dest, sendtag)
        FTRequest(send, self, sendbuf, "Sendrecv").Wait()
        FTRequest(recv, self, recvbuf, "Sendrecv").Wait(status)

    # -- collectives of Python objects (used for metadata) --------------------------------
    def allgather(self, obj: Any) -> list[Any]:
        data = np.frombuffer(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        sizes = np.zeros(self.Get_size(), dtype=np.int64)
        self.Allgather(np.array([data.size], dtype=np.int64), sizes)
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        self.Allgatherv(data, [out, (sizes.tolist(), displs.tolist()), MPI.BYTE])
        return [pickle.loads(out[d:d + s].tobytes()) for d, s in zip(displs, sizes)]

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        values = self.allgather(obj)
        return values if self.Get_rank() == root else None

    def bcast(self, obj: Any, root: int = 0) -> Any:
        data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL) if self.Get_rank() == root else b""
        size = np.array([len(data)], dtype=np.int64)
        self.Bcast(size, root)
        buf = (np.frombuffer(data, dtype=np.uint8).copy() if self.Get_rank() == root
               else np.empty(int(size[0]), dtype=np.uint8))
        self.Bcast(buf, root)
        return pickle.loads(buf.tobytes())

    def allreduce(self, obj: Any, op: Any = MPI.SUM) -> Any:
        return _fold(op, self.allgather(obj))

    def barrier(self) -> None:
        self.Barrier()


for _name in _NONBLOCKING:
    setattr(FTComm, _name, _nonblocking(_name))
for _name in _BLOCKING:
    setattr(FTComm, _name, _blocking(_name, "I" + _name.lower()))


def adopt(comm: Any, known_dead: Iterable[int] | None = None, name: str = "",
          key: str | None = None) -> FTComm:
    """``comm`` (an ``mpi4py`` intracommunicator, not freed: the same MPI handle) as an
    :class:`FTComm`; ``known_dead``: ranks dead before it was made (default: those known
    now); ``key``: :attr:`FTComm.key` (those derived from it are built with the
    backend's ``create``)."""
    if isinstance(comm, FTComm):  # mpi4py makes the results of Dup etc. of our type
        return comm if "watcher" in comm.__dict__ else comm.ft_init(known_dead, name, key)
    return FTComm(comm).ft_init(known_dead, name, key)


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
            if isinstance(comm, FTComm):
                _backend().interrupt(comm)
            raise comm.failure(op)
    ok, value = out[0]
    if not ok:
        if _backend().failure_error(value, comm if isinstance(comm, FTComm) else None):
            ABANDONED.append((thread, args))
            raise failure(comm, op, value) from None
        raise value
    return value
