"""What fault-tolerant mode does differently on each MPI library (the seam between
:mod:`commlib.fault.fault_tolerance` and
:attr:`commlib.mpi.mpi_impl.Implementation.fault_tolerance`).

Fault-tolerant mode is the same everywhere: every operation is nonblocking and waited on
with failure detection, a dead peer becomes :class:`~commlib.base.errors.PeerFailure` on every
survivor, the survivors agree with commlib's own protocol (:mod:`commlib.fault.agreement`: who is
left, and each one's value) and build their communicator. What differs is here:

* :class:`Pmi` (the MPICH wheel): no MPI operation ever completes with an error once a
  peer died (ULFM aborts in ch4). Peers on other machines are read from the launcher's
  list of dead processes, ``MPIX_Comm_get_failed`` through ctypes (:class:`Mpix`; MPICH
  ABI: ``int`` handles). Nothing interrupts a wait: a waiter given up on stays in
  ``MPI_Wait``. The survivors' communicator is ``MPI_Comm_create_group`` over the control
  communicator.
* :class:`Local` (Intel MPI): as :class:`Pmi`, but its launcher reports no death
  (``MPIX_Comm_get_failed`` stays empty): only the peers of this machine are watched (by
  process id), so a world beyond one machine is refused at ``init`` unless a store-backed
  world's heartbeats watch it.
* :class:`Ulfm` (Open MPI 5, ``mpirun --with-ft ulfm``): User-Level Failure Mitigation.
  ``MPI_Comm_get_failed`` (mpi4py's ``Comm.Get_failed``; Open MPI's handles are pointers,
  so never :class:`Mpix`) is the launcher's list (read for peers on other machines; those
  of this machine are watched by process id first); an operation waiting on a dead peer
  completes with ``MPI_ERR_PROC_FAILED`` (or ``MPI_ERR_REVOKED``, or another class on a
  revoked communicator): :meth:`failure_error` says so, and the wait turns it into
  :class:`PeerFailure`; a wait given up on is
  interrupted with ``MPI_Comm_revoke`` (:meth:`interrupt`: the pending operations of that
  communicator end with an error on every member, and the waiter thread is free again);
  a receive or probe from ``MPI_ANY_SOURCE`` fails until the failures are acknowledged
  (:func:`iprobe_any`: ``MPI_Comm_ack_failed``); and since ``MPI_Comm_create_group`` fails
  on a parent holding a dead process, the survivors' communicator is
  ``MPI_Comm_create_from_group`` (only its members take part, as in MPICH's path).
  Open MPI 5.0's context-id allocation (``MPI_Comm_idup``, ``MPI_Comm_dup``, ``split``,
  ``MPI_Comm_create_group``: a nonblocking allreduce over the parent) does not survive a
  death during it: the ``MPI_Comm_idup`` ends with ``MPI_ERR_INTERN``, and every later
  allocation of that process waits for good, its peers all alive (5.0.11: a probe, 2 of 2
  survivors; a spare's death while the survivors duplicated the group they had just
  merged it into hung the next group's first ``MPI_Comm_idup``, 3 of 4 join cases of
  ``tests/test_elastic_spares.py``). ``MPI_Comm_create_from_group`` takes its context id
  from PMIx and still works then, so every communicator made after a failure (the
  survivors', the merged group's: :attr:`Backend.derive_by_create`) and every one derived
  from it is built with it (:meth:`Backend.create`, under a name its members derive alike:
  ``commlib.fault.fault_tolerance.FTComm.Dup``), never through the allocator.
  ``MPI_Comm_shrink``/``MPI_Comm_agree`` are not used: the agreement must carry each
  survivor's value (its committed step) and count ranks that left the program (still
  alive for a while, which ``MPI_Comm_shrink`` would wait for), and one protocol on every
  library keeps one set of guarantees (:mod:`commlib.fault.agreement`). The launch must enable
  ULFM (MPI_T variable ``mpi_ft_enable``): checked at ``init``.
* :class:`Refused` (a library without any of these): ``init`` raises
  :class:`~commlib.base.errors.CommError` naming the library, why, and what to use instead.
"""
from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Callable, Iterable
from typing import Any

from mpi4py import MPI

from ..base.errors import CommError
from ..mpi.mpi_impl import Implementation, current


class Mpix:
    """``MPIX_Comm_get_failed(MPI_COMM_WORLD)`` through ctypes, as world ranks (MPICH's
    ABI only: the communicator and group handles are ``int``)."""

    def __init__(self) -> None:
        self.fn = None
        try:
            lib = ctypes.CDLL(MPI.__file__)  # resolves through libmpi, which it links
            fn = lib.MPIX_Comm_get_failed
        except (OSError, AttributeError):
            return
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint)]
        fn.restype = ctypes.c_int
        self.fn = fn
        self.world = MPI.COMM_WORLD.Get_group()

    def __call__(self) -> list[int]:
        if self.fn is None or MPI.Is_finalized():
            return []
        handle = ctypes.c_uint(0)
        if self.fn(MPI._handleof(MPI.COMM_WORLD), ctypes.byref(handle)) != 0:
            return []
        return _world_ranks(MPI.Group.fromhandle(handle.value), self.world)


class UlfmFailed:
    """``MPI_Comm_get_failed(MPI_COMM_WORLD)`` (mpi4py's ``Comm.Get_failed``): the dead
    processes this process knows of (a local call, no message), as world ranks."""

    def __init__(self) -> None:
        self.world = MPI.COMM_WORLD.Get_group()

    def __call__(self) -> list[int]:
        if MPI.Is_finalized():
            return []
        return _world_ranks(MPI.COMM_WORLD.Get_failed(), self.world)


def _world_ranks(group: Any, world: Any) -> list[int]:
    try:
        n = group.Get_size()
        return list(MPI.Group.Translate_ranks(group, list(range(n)), world)) if n else []
    finally:
        group.Free()


class Backend:
    """Fault-tolerant mode on commlib's own means (the base of every backend)."""

    key = ""
    #: The MPI call that builds the survivors' communicator (named in errors).
    create_op = "Comm_create_group"
    #: Whether the communicators made after a failure (the survivors', a merged group's)
    #: and those derived from them (``Dup``, ``Split``, ``Create_group``,
    #: ``Split_type``) are built with :meth:`create` instead of the library's
    #: ``MPI_Comm_idup``/``MPI_Comm_create_group`` (Open MPI: :class:`Ulfm`).
    derive_by_create = False

    def __init__(self, impl: Implementation) -> None:
        self.impl = impl

    def detector(self) -> Callable[[], Iterable[int]] | None:
        """The launcher's or library's list of dead processes (world ranks), read by the
        watcher when some peer is not on this machine; None when there is none."""
        return None

    def check(self, covered: bool, store: bool, size: int) -> None:
        """At ``init`` (fault-tolerant mode, every rank): raise :class:`CommError` when
        this job cannot survive a dead rank. ``covered``: every other rank is watched by
        process id (one machine); ``store``: a store-backed world (heartbeats); ``size``:
        ranks in ``MPI_COMM_WORLD``."""

    def failure_error(self, exc: BaseException, comm: Any = None) -> bool:
        """Whether the MPI error ``exc`` (of an operation on ``comm``, if known) reports a
        dead peer or a revoked communicator (then the caller raises
        :class:`PeerFailure`)."""
        return False

    def interrupt(self, comm: Any) -> bool:
        """End the pending operations of ``comm`` (a failed communicator) on every member;
        whether it was done (otherwise the waits stay in MPI for good)."""
        return False

    def acknowledge(self, comm: Any) -> None:
        """Let receives and probes from ``MPI_ANY_SOURCE`` go on on ``comm`` despite the
        dead processes known now."""

    def create(self, parent: Any, group: Any, tag: int, key: str) -> Any:
        """The communicator of ``group`` (a group of ``parent``, every member alive, each
        calling this with the same ``tag`` and ``key``), made by its members only."""
        return MPI.Intracomm.Create_group(parent, group, tag)


class Pmi(Backend):
    key = "pmi"

    def detector(self) -> Callable[[], Iterable[int]] | None:
        mpix = Mpix()
        return mpix if mpix.fn is not None else None


class Local(Backend):
    key = "local"

    def check(self, covered: bool, store: bool, size: int) -> None:
        if not (covered or store or size == 1):
            raise CommError(
                f"commlib.init (rank {MPI.COMM_WORLD.Get_rank()}): fault-tolerant mode on "
                f"{self.impl.describe()} needs every rank on one machine: "
                f"{self.impl.fault_tolerance_refusal}")


class Ulfm(Backend):
    key = "ulfm"
    create_op = "Comm_create_from_group"
    derive_by_create = True  # (Open MPI's context-id allocator, see the module docstring)
    FAILURES = frozenset((MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED))

    def detector(self) -> Callable[[], Iterable[int]] | None:
        return UlfmFailed()

    def check(self, covered: bool, store: bool, size: int) -> None:
        if size == 1 or not self.impl.keep_running_cvar:
            return
        if cvar_true(self.impl.keep_running_cvar) is False:
            raise CommError(
                f"commlib.init (rank {MPI.COMM_WORLD.Get_rank()}): fault-tolerant mode on "
                f"{self.impl.describe()} needs its User-Level Failure Mitigation, which "
                f"this job was launched without ({self.impl.keep_running_cvar} is off): a "
                f"dead rank would end the whole job. Launch with `mpirun "
                f"{' '.join(self.impl.keep_running_args or ())} -n N python script.py`, "
                f"or leave fault-tolerant mode off")

    def failure_error(self, exc: BaseException, comm: Any = None) -> bool:
        if not isinstance(exc, MPI.Exception):
            return False
        try:
            if exc.Get_error_class() in self.FAILURES:
                return True
        except MPI.Exception:
            return False
        # Another class while the communicator is revoked or holds a dead process: a
        # nonblocking collective whose next round could not start reports MPI_ERR_OTHER
        # ("Error in NBC_Start_round", 1 of 14 'exit' jobs): the failure too.
        try:
            if isinstance(comm, MPI.Comm) and comm != MPI.COMM_NULL and comm.Is_revoked():
                return True
            failed = (comm if isinstance(comm, MPI.Comm) and comm != MPI.COMM_NULL
                      else MPI.COMM_WORLD).Get_failed()
            try:
                return failed.Get_size() > 0
            finally:
                failed.Free()
        except MPI.Exception:
            return False

    def interrupt(self, comm: Any) -> bool:
        try:
            MPI.Comm.Revoke(comm)
        except MPI.Exception:
            return False
        return True

    def acknowledge(self, comm: Any) -> None:
        comm.Ack_failed()

    def create(self, parent: Any, group: Any, tag: int, key: str) -> Any:
        tagged = "commlib." + hashlib.sha1(f"{key}/{tag}".encode()).hexdigest()
        return MPI.Intracomm.Create_from_group(group, tagged, MPI.INFO_NULL,
                                               MPI.ERRORS_RETURN)


class Refused(Backend):
    key = ""

    def check(self, covered: bool, store: bool, size: int) -> None:
        why = self.impl.fault_tolerance_refusal or (
            "commlib knows no way to survive a dead rank on it; run fault-tolerant jobs on "
            "the mpich wheel (pip install mpich) or Open MPI 5 (mpirun --with-ft ulfm)")
        raise CommError(f"commlib.init (rank {MPI.COMM_WORLD.Get_rank()}): fault-tolerant "
                        f"mode (COMMLIB_FAULT_TOLERANT=1 or commlib.init(fault_tolerant="
                        f"True)) is not available on {self.impl.describe()}: {why}")


BACKENDS: dict[str | None, type[Backend]] = {"pmi": Pmi, "local": Local, "ulfm": Ulfm}
_backend: Backend | None = None


def backend() -> Backend:
    """The backend of the MPI library in use (cached)."""
    global _backend
    if _backend is None:
        impl = current()
        _backend = BACKENDS.get(impl.fault_tolerance, Refused)(impl)
    return _backend


def cvar_true(name: str) -> bool | None:
    """The MPI_T control variable ``name`` read as a truth value through ctypes (Open MPI's
    ABI: handles are pointers); None where it cannot be read."""
    try:
        lib = ctypes.CDLL(MPI.__file__)
        provided, index, count = ctypes.c_int(), ctypes.c_int(-1), ctypes.c_int()
        handle = ctypes.c_void_p()
        lib.MPI_T_cvar_handle_alloc.argtypes = [ctypes.c_int, ctypes.c_void_p,
                                                ctypes.POINTER(ctypes.c_void_p),
                                                ctypes.POINTER(ctypes.c_int)]
        lib.MPI_T_cvar_read.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.MPI_T_cvar_handle_free.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        if lib.MPI_T_init_thread(MPI.THREAD_MULTIPLE, ctypes.byref(provided)) != 0:
            return None
        try:
            if lib.MPI_T_cvar_get_index(name.encode(), ctypes.byref(index)) != 0 or \
                    lib.MPI_T_cvar_handle_alloc(index.value, None, ctypes.byref(handle),
                                                ctypes.byref(count)) != 0:
                return None
            value = (ctypes.c_int64 * max(1, count.value))()  # zeroed: a bool fills 1 byte
            ok = lib.MPI_T_cvar_read(handle, value) == 0
            lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
            return bool(value[0]) if ok else None
        finally:
            lib.MPI_T_finalize()
    except (OSError, AttributeError):
        return None


# -- the calls of commlib's control communicators (agreement, exit messages) ---------------

def iprobe_any(comm: Any, tag: int, status: Any) -> bool:
    """``comm.Iprobe(MPI_ANY_SOURCE, tag, status)``, acknowledging the failures known (ULFM
    fails it until then) and probing again."""
    b = backend()
    for _ in range(8):
        try:
            return comm.Iprobe(MPI.ANY_SOURCE, tag, status)
        except MPI.Exception as exc:
            if not b.failure_error(exc, comm):
                raise
            b.acknowledge(comm)
    return False


def isend(comm: Any, obj: Any, dest: int, tag: int) -> Any:
    """``comm.isend(obj, dest, tag)``, or None when the library already knows ``dest``
    dead (ULFM refuses the send)."""
    try:
        return comm.isend(obj, dest=dest, tag=tag)
    except MPI.Exception as exc:
        if backend().failure_error(exc, comm):
            return None
        raise


def sent(request: Any) -> bool:
    """Whether the send ``request`` (of :func:`isend`) is done, or ended with a failure."""
    if request is None:
        return True
    try:
        return request.Test()
    except MPI.Exception as exc:
        if backend().failure_error(exc):
            return True
        raise
