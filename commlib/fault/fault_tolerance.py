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
from collections.abc import Iterable
from functools import reduce as _fold
from typing import Any

import numpy as np
from mpi4py import MPI

from ..base.errors import CommError
from ..base.options import options
from ..mpi.watchdog import postpone

# Detection (the watcher thread and its detectors) is commlib.fault.failure_detection's, the
# waits commlib.fault.waits's, the calls on a helper thread commlib.fault.helper_thread's;
# these names are part of this module's API too.
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
from .helper_thread import (  # noqa: F401
    CREATE_ATTEMPTS,
    CallTimedOut,
    _own_handles,
    create_limit,
    in_thread,
)
from .waits import (  # noqa: F401
    ABANDONED,
    COUNTS,
    DETECT_S,
    INTERRUPT_S,
    FTRequest,
    _blocking,
    _Box,
    _FTCommBase,
    _nonblocking,
    _start,
    _Waiter,
    _waiter,
    failure,
)

__all__ = ["ABANDONED", "FTComm", "FTRequest", "adopt", "failure", "in_thread", "POLL_S",
           "SOURCES", "StoreDetector", "Watcher", "available", "dead", "dead_in_world",
           "watcher"]

_NONBLOCKING = ("Iallreduce", "Ibcast", "Ibarrier", "Iallgather", "Iallgatherv", "Ireduce",
                "Ireduce_scatter", "Ireduce_scatter_block", "Igather", "Igatherv",
                "Iscatter", "Iscatterv", "Ialltoall", "Ialltoallv", "Isend", "Irecv",
                "Issend")
_BLOCKING = ("Allreduce", "Bcast", "Barrier", "Allgather", "Allgatherv", "Reduce",
             "Reduce_scatter", "Reduce_scatter_block", "Gather", "Gatherv", "Scatter",
             "Scatterv", "Alltoall", "Alltoallv", "Send", "Ssend")


class FTComm(_FTCommBase):
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

    # -- communicator creation ----------------------------------------------------------
    def _create(self, group: Any, what: tuple[Any, ...], agree: bool = False) -> Any:
        """The communicator of ``group`` (of this one), built by its members with the
        backend's :meth:`~commlib.fault.ft_backend.Backend.create` under a name derived
        from this one's :attr:`key` and ``what`` (the call, the same on every member), on
        a helper thread (:func:`in_thread`); only where :attr:`key` is set.

        An attempt that neither ends nor fails within :func:`create_limit` is given up and
        the members build it again under a new name (Open MPI 5, once in 50 soak runs
        under load: every member's ``MPI_Comm_create_from_group`` of a merged world's first
        ``Dup`` hung with every member alive); after :data:`CREATE_ATTEMPTS` attempts it
        raises :class:`CallTimedOut`; an attempt that fails with an MPI error that names no
        dead peer is built again alike. ``agree`` (every member of this communicator takes
        part in the call: ``Dup``, ``Split``): after each attempt the members tell each
        other whether they have it, and all build it again unless all have it (a member
        whose attempt ended just after another's gave up; ``group`` None: a rank of
        ``Split`` in no group, which takes part in that agreement only and gets
        ``MPI.COMM_NULL``)."""
        b = _backend()
        n = self._derived.get(what, 0)
        self._derived[what] = n + 1  # (members call creations in the same order)
        base = f"{self.key}/{'/'.join(map(str, what))}#{n}"
        me = MPI.COMM_WORLD.Get_rank()
        for attempt in range(CREATE_ATTEMPTS):
            key = base if attempt == 0 else f"{base}~{attempt}"
            new, why = None, "was not built on every member"
            # the collective that needs this communicator (a shared-memory window's first
            # use builds several) is not aborted by its deadline while an attempt runs and
            # its members agree on it: each attempt bounds itself (create_limit)
            postpone(create_limit() + float(options.timeout))
            if group is None:  # (Split's ranks in no group: they only agree)
                new = MPI.COMM_NULL
            else:
                try:
                    new = in_thread(self, b.create_op, b.create, self, group, attempt, key,
                                    limit_s=create_limit())
                except CallTimedOut:
                    why = (f"did not complete within {create_limit():g} s with no peer "
                           f"dead")
                except MPI.Exception as exc:  # (not a failure: PeerFailure passes)
                    # Open MPI 5, once in 20 soak runs: MPI_ERR_UNSUPPORTED_OPERATION from
                    # a merged group's first Dup after a death during a spare's joining
                    why = f"failed here ({exc})"
            if agree and not all(self.allgather(new is not None)):
                if new is not None and new != MPI.COMM_NULL:  # (never used: kept)
                    ABANDONED.append(new)
                new = None
            if new is not None:
                return new if new == MPI.COMM_NULL else adopt(new, self.known_dead,
                                                              self.name, key)
            if attempt == CREATE_ATTEMPTS - 1:
                raise CallTimedOut(f"commlib (rank {me}): MPI {b.create_op} of "
                                   f"{self.name or 'a communicator'} ({what[0]}) {why}, "
                                   f"attempt {CREATE_ATTEMPTS} of {CREATE_ATTEMPTS}")
            print(f"commlib (rank {me}): MPI {b.create_op} ({what[0]}) {why}; building it "
                  f"again under a new name (attempt {attempt + 2} of {CREATE_ATTEMPTS})",
                  flush=True)
        raise AssertionError("unreachable")

    def Dup(self, info: Any = None) -> FTComm:
        self.check("Comm_idup")
        if self.key is not None:  # (Open MPI after a failure: not through its allocator)
            group = self.Get_group()
            try:
                return self._create(group, ("dup",), agree=True)
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
            if self.key is not None:  # (see Dup: every rank agrees on each attempt)
                return self._create(None, ("none", self._creations), agree=True)
            return MPI.COMM_NULL
        members = sorted((k, r) for r, (c, k) in enumerate(pairs) if c == color)
        group = self.Get_group().Incl([r for _, r in members])
        try:
            if self.key is not None:  # (see Dup; every member takes part: agree)
                return self._create(group, ("group", self._creations,
                                            tuple(self._world_of(group))), agree=True)
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
            return self._create(group, ("group", tag, tuple(self._world_of(group))))
        new = in_thread(self, "Comm_create_group", MPI.Intracomm.Create_group, self, group,
                        tag)
        return adopt(new, self.known_dead, self.name)

    def _world_of(self, group: Any) -> list[int]:
        """The base ranks of ``group``'s members."""
        return MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                         self.watcher.base)

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
