"""Forming a real MPI world from a launcher's environment, and leaving it cleanly.

:func:`form` turns a :class:`~commlib.mpi.launch.environment.Job` into ``MPI.COMM_WORLD``:

1. open the job's torch ``TCPStore``: torchrun's agent's when
   ``TORCHELASTIC_USE_AGENT_STORE=True``, else the one rank 0 hosts on
   ``MASTER_ADDR:MASTER_PORT`` with ``multi_tenant=True`` exactly as torch's ``env://``
   would, so a later ``init_process_group()`` on rank 0 reuses the same server (commlib
   listens on no socket of its own);
2. remove the shared-memory segments MPICH left from earlier attempts of this run (ranks
   killed by torchrun before a restart never unlink theirs);
3. start a PMI-1 server (:class:`~commlib.mpi.launch.pmi.Server`) in a thread, on one end of a
   ``socketpair``; point ``PMI_FD``/``PMI_RANK``/``PMI_SIZE`` at the other end;
4. initialize MPI through ctypes, without the GIL (:mod:`commlib.mpi.launch.libmpi`), with
   ``MPIR_CVAR_NO_COLLECTIVE_FINALIZE=1``; then drop ``PMI_FD`` and the CVAR again (child
   processes must not find them; ``PMI_RANK``/``PMI_SIZE`` stay, as under ``mpiexec``);
5. watch the store for an ``MPI_Abort`` of another rank (a monitor thread, every
   :data:`POLL_S` seconds): the process then leaves with that rank's exit code, as
   under ``mpiexec`` (a rank that loses the store, because its host left so, leaves
   with exit code 1, unless a standby store takes over: fault-tolerant mode,
   :mod:`commlib.mpi.launch.standby`, started here once MPI is initialized).

Leaving. MPI must be finalized late, as under ``mpiexec`` (mpi4py does it after the
interpreter's teardown, where objects such as a ``DistributedDataParallel`` free their
communicators), but by then Python's threads are gone, so nothing may need PMI any more:

* ``MPIR_CVAR_NO_COLLECTIVE_FINALIZE=1`` removes the one PMI exchange of ``MPI_Finalize``
  (the UCX netmod's barrier before it disconnects; UCX still flushes every endpoint);
* libmpi's last PMI message, ``finalize``, comes from its C exit handler after Python is
  gone: its answer is written in advance, by an ``atexit`` handler (after commlib's own,
  which stops commlib's threads) that also stops the monitor and the server; the socket
  stays open until the process ends. An explicit ``MPI.Finalize()`` answers in advance
  too (so an MPI call after it, which makes MPICH ``exit`` holding the GIL, cannot hang);
* a rank that hosts a store (the job's, or a standby) stays until every rank has left it
  (or a rank aborts, or ``COMMLIB_TIMEOUT`` passes); a rank that loses the store while it
  still runs, with no standby to switch to, knows its host ended abnormally and leaves
  with exit code 1, as an MPI launcher would end it.

The interpreter then exits as usual, with its own exit status.
"""
from __future__ import annotations

import atexit
import datetime
import glob
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from . import environment, libmpi, standby
from .environment import Job
from .pmi import Server
from .space import StoreSpace
from .standby import _note

POLL_S = 0.5
#: The monitor's poll while a standby store is being put in place (fault-tolerant mode,
#: :mod:`commlib.mpi.launch.standby`), or the store's host is known dead.
URGENT_S = 0.05
DEFAULT_TIMEOUT_S = 1800.0


def timeout_s(environ: Any = None) -> float:
    """Seconds to wait for the other ranks (store connection, PMI barriers):
    ``COMMLIB_TIMEOUT``, as for commlib's collectives."""
    env = os.environ if environ is None else environ
    try:
        value = float(env.get("COMMLIB_TIMEOUT", DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return value if value > 0 else DEFAULT_TIMEOUT_S


def open_store(job: Job, timeout: float) -> tuple[Any, bool]:
    """(store, whether this process hosts its server)."""
    from torch.distributed import TCPStore
    td = datetime.timedelta(seconds=timeout)
    if job.use_agent_store:
        return TCPStore(job.master_addr, job.master_port, is_master=False, timeout=td,
                        wait_for_workers=False), False
    host = job.rank == 0
    return TCPStore(job.master_addr, job.master_port, world_size=None, is_master=host,
                    timeout=td, wait_for_workers=False, multi_tenant=True), host


def fnv1a(text: str) -> int:
    """MPICH's ``HASH_FNV`` (32-bit FNV-1a) of ``text``."""
    h = 2166136261
    for b in text.encode():
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h


def shm_segments(kvsname: str) -> list[str]:
    """``/dev/shm`` files of MPICH's shared memory for the world named ``kvsname``:
    ``mpich_shm_<world id>_<node>`` and ``mpich_vci_...``, the world id being the 32-bit
    FNV-1a hash of the name (MPICH 5.0; later versions hash ``"<name>-1"``, the first
    initialization: both are looked for)."""
    found: list[str] = []
    for text in (kvsname, kvsname + "-1"):
        wid = f"{fnv1a(text):x}"
        found += glob.glob(f"/dev/shm/mpich_shm_{wid}_*") + \
            glob.glob(f"/dev/shm/mpich_vci_{wid}_*")
    return sorted(set(found))


class StoreWorld:
    """An MPI world formed from a store: what later layers may use (issue 21's failure
    detection among them): :attr:`store` (the torch store client; share it through
    :meth:`call`), :attr:`namespace` (prefix of this attempt's keys; put your own keys
    under :meth:`key`), :attr:`rank`/:attr:`size` (``MPI.COMM_WORLD``'s),
    :attr:`local_rank`/:attr:`local_size` (MPI's node), :attr:`node_of` (node id of each
    rank), :attr:`dead` (ranks answered to MPICH's ``PMI_dead_processes``, which
    ``MPIX_Comm_get_failed`` reads: add a rank once it is known dead), and
    :meth:`on_poll` (a callback the monitor thread runs every :data:`POLL_S` s)."""

    def __init__(self, job: Job, store: Any, hosting: bool, space: StoreSpace,
                 server: Server, server_sock: socket.socket, lib: Any, timeout: float) -> None:
        self.job, self.store, self.hosting, self.space = job, store, hosting, space
        self.server, self._server_sock, self._lib = server, server_sock, lib
        self.timeout = timeout
        self.rank, self.size = job.rank, job.size
        self.namespace = space.ns
        self.kvsname = space.kvsname
        self.pid = os.getpid()
        self.node_of: list[int] = []
        self.local_rank = self.local_size = 0
        self.bootstrap_s = 0.0
        self.timings: dict[str, float] = {}
        self.thread_level = -1
        self._polls: list[Callable[[StoreWorld], None]] = []
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="commlib-launch-monitor",
                                         daemon=True)
        self._left = self._answered = False

    # -- for later layers --------------------------------------------------------------
    @property
    def dead(self) -> set[int]:
        return self.space.dead

    def key(self, name: str) -> str:
        return self.space.key(name)

    def call(self, method: str, *args: Any) -> Any:
        """``store.<method>(*args)``, serialized with commlib's own use of the client."""
        return self.space._call(method, *args)

    def on_poll(self, callback: Callable[[StoreWorld], None]) -> None:
        self._polls.append(callback)

    def hosts_a_store(self) -> bool:
        """Whether a store another rank may use lives in this process (the job's store,
        or a standby: :mod:`commlib.mpi.launch.standby`); it then stays at exit until
        every rank has left."""
        return self.hosting or bool(getattr(self.store, "hosts_a_store", bool)())

    # -- monitor -----------------------------------------------------------------------
    def _watch(self) -> None:
        failures = 0
        last = time.monotonic()
        urgent = getattr(self.store, "urgent", None)
        while not self._stop.wait(POLL_S if urgent is None else URGENT_S):
            # every POLL_S; every URGENT_S while a standby store is wanted but missing, or
            # the store's host is known dead (standby: switch and replace it at once)
            if time.monotonic() - last < POLL_S and not (urgent and urgent()):
                continue
            last = time.monotonic()
            try:
                self.space.refresh()
                aborted = self.space.aborted()
                failures = 0
            except Exception:  # noqa: BLE001 - the store is unreachable
                failures += 1
                if failures >= 2 and not self._stop.is_set():
                    self._store_lost()
                continue
            if aborted is not None and aborted[0] != self.rank:
                self.follow_abort(*aborted)
            for callback in list(self._polls):
                try:
                    callback(self)
                except Exception as exc:  # noqa: BLE001 - a hook never kills the monitor
                    _note(self.rank, f"launch poll hook {callback!r} failed: {exc!r}")

    def _host(self) -> str:
        if isinstance(self.store, standby.ReplicatedStore):
            addr, port = self.store.address
            return f"rank {self.store.host} (the store at {addr}:{port}; no standby store " \
                   f"in place to take over)"
        who = "torchrun's agent" if self.job.use_agent_store else "rank 0"
        return f"{who} (the store at {self.job.master_addr}:{self.job.master_port})"

    def _store_lost(self) -> None:
        # The store's host waits at exit until every rank has left: losing it while this
        # rank still runs means the host ended abnormally (an abort, a crash). mpiexec
        # would end this rank too.
        _note(self.rank, f"lost {self._host()} while this rank still runs: it ended "
                         f"abnormally; leaving with exit code 1, as an MPI launcher would")
        os._exit(1)

    def follow_abort(self, who: int, code: int) -> None:
        """Rank ``who`` called ``MPI_Abort(code)``: leave at once with ``code``, as under
        ``mpiexec`` (a rank that loses the store when its host leaves so ends too)."""
        _note(self.rank, f"rank {who} called MPI_Abort (exit code {code}); leaving with "
                         f"exit code {code}, as under mpiexec")
        os._exit(code or 1)

    # -- exit --------------------------------------------------------------------------
    def answer_exit(self) -> None:
        """Stop the monitor and the PMI server, and answer in advance the PMI
        ``finalize`` libmpi will send from its C exit handler (idempotent). No PMI
        exchange is possible after this."""
        if self._answered:
            return
        self._answered = True
        self._stop.set()
        if self._monitor.is_alive() and self._monitor is not threading.current_thread():
            self._monitor.join(2 * POLL_S + 1)
        self.server.stop()
        if not self.server.finalized:
            try:
                self._server_sock.sendall(b"cmd=finalize_ack rc=0\n")
            except OSError:
                pass
        self._server_sock.detach()  # open until the process ends: the answer waits there

    def leave(self) -> None:
        """At exit: :meth:`answer_exit`, then tell the store this rank is done with it
        (its host waits for every rank). MPI itself is finalized later by mpi4py."""
        if self._left or os.getpid() != self.pid:
            return
        self._left = True
        self.answer_exit()
        try:
            self.space.leave()
        except Exception:  # noqa: BLE001 - the store's host may be gone already
            return
        if isinstance(self.store, standby.ReplicatedStore):
            self.store.left = True
        if not self.hosts_a_store():
            return
        # The host stays until every rank has left (they may still be working), or a
        # rank aborts, or COMMLIB_TIMEOUT passes (a rank that died stays "not left").
        deadline = time.monotonic() + self.timeout
        while not self.space.wait_all_left(POLL_S):
            aborted = self.space.aborted()
            if aborted is not None:
                self.follow_abort(*aborted)
            if time.monotonic() > deadline:
                _note(self.rank, f"leaving the store although ranks are still in it after "
                                 f"{self.timeout:g} s (COMMLIB_TIMEOUT)")
                return


def _finalize_wrapper(original: Callable[[], None], world: StoreWorld) -> Callable[[], None]:
    def Finalize() -> None:
        """Terminate the MPI execution environment (mpi4py's ``MPI.Finalize``; in a
        store-backed world ``MPI_Finalize`` is called through ctypes, which releases the
        GIL: Intel MPI sends its PMI ``finalize`` from ``MPI_Finalize`` and waits for the
        answer of this process's PMI server thread, which mpi4py's call, holding the GIL,
        would never let run; then libmpi's last PMI message is answered in advance)."""
        lib = world._lib
        if lib is None or not hasattr(lib, "MPI_Finalize"):
            original()
        else:
            err = lib.MPI_Finalize()
            if err != 0:
                raise RuntimeError(f"MPI_Finalize failed with MPI error code {err}")
        world.answer_exit()
    return Finalize


def refuse(MPI: Any, job: Job) -> None:
    """Raise ``RuntimeError`` naming what to do instead when the MPI library mpi4py loaded
    cannot be given a world from a store (:attr:`commlib.mpi.mpi_impl.Implementation.
    store_world`: Open MPI), before anything is started: every rank fails at once."""
    from ..mpi_impl import current
    impl = current(MPI)
    if impl.store_world:
        return
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "script.py"
    plugins = " or ".join(f"`srun --mpi={p}`" for p in impl.slurm_mpi_plugins)
    raise RuntimeError(
        f"{impl.describe()} cannot join the processes {job.launcher} started into one MPI "
        f"world: {impl.store_world_refusal or 'commlib does not know this MPI library'}. "
        f"Launch with `mpirun -n {job.size} python {script}` instead (commlib then sets "
        f"torch's env:// variables from MPI){', or ' + plugins + ' under Slurm' if plugins else ''}, "
        f"or use an MPICH-ABI runtime, which commlib can start from a store "
        f"(`pip install mpich` or `pip install impi-rt` in place of `{impl.wheel or 'it'}`). "
        f"COMMLIB_LAUNCH=mpi runs each process as a world of its own.")


def form(job: Job, environ: Any = None) -> StoreWorld:
    """Make ``MPI.COMM_WORLD`` the job's world (see the module docstring). MPI must not
    be initialized yet."""
    env = os.environ if environ is None else environ
    start = time.perf_counter()
    timeout = timeout_s(env)
    MPI = libmpi.import_mpi_uninitialized()
    refuse(MPI, job)
    lib = libmpi.load(MPI)
    import torch.distributed  # noqa: F401 - timed on its own: most of the cost when cold
    imported = time.perf_counter()
    store, hosting = open_store(job, timeout)
    replicated = None
    if not job.use_agent_store and job.size > 1 and standby.wanted(env):
        # fault-tolerant mode: the store's host is no single point of failure
        replicated = store = standby.ReplicatedStore(
            store, 0, job.rank, job.size, job.namespace, (job.master_addr, job.master_port),
            timeout, dead=lambda: space.dead, on_failover=lambda old: space.store_lost(old))
    space = StoreSpace(store, job.namespace, job.rank, job.size, job.node, timeout)
    if replicated is not None:
        replicated.shared_keys = space.shared_keys
    for previous in job.previous_namespaces():
        name = space.previous_kvsname(previous)
        for path in shm_segments(name) if name else []:
            try:
                os.unlink(path)
            except OSError:
                pass
    server_sock, client_sock = socket.socketpair()
    server = Server(server_sock, space, job.rank)
    world = StoreWorld(job, store, hosting, space, server, server_sock, lib, timeout)
    server.start()
    # PMI_RANK/PMI_SIZE stay, as under mpiexec (what tools read to find the MPI world;
    # without PMI_FD a child process's libmpi is a singleton); PMI_FD names a descriptor
    # of this process only, and the CVAR is read by MPI_Init alone.
    env.update(PMI_RANK=str(job.rank), PMI_SIZE=str(job.size))
    init_vars = {"PMI_FD": str(client_sock.fileno()), "MPIR_CVAR_NO_COLLECTIVE_FINALIZE": "1"}
    saved = {k: env.get(k) for k in init_vars}
    env.update(init_vars)
    connected = time.perf_counter()
    try:
        world.thread_level = libmpi.initialize(MPI, lib)
    finally:
        for k, v in saved.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
    client_sock.detach()  # libmpi owns this end now
    env[environment.PARENT_VARIABLE] = str(os.getpid())
    atexit.register(world.leave)
    MPI.Finalize = _finalize_wrapper(MPI.Finalize, world)
    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (job.rank, job.size):
        raise RuntimeError(f"MPI formed rank {comm.Get_rank()} of {comm.Get_size()}, "
                           f"not the launcher's {job.rank} of {job.size}")
    world.node_of = space.mapping()[1]
    node = world.node_of[job.rank]
    world.local_rank = world.node_of[:job.rank].count(node)
    world.local_size = world.node_of.count(node)
    for k, v in job.exported:
        env.setdefault(k, v)
    if replicated is not None:
        _first_standby(world, replicated)
    world._monitor.start()
    done = time.perf_counter()
    world.bootstrap_s = done - start
    world.timings = {"import_torch_s": imported - start, "store_s": connected - imported,
                     "mpi_init_s": done - connected}
    return world


def _first_standby(world: StoreWorld, replicated: standby.ReplicatedStore) -> None:
    """After ``MPI_Init``: the first standby store's host starts and announces it; the
    others connect to it (waiting a moment for the announcement; else the monitor
    connects later)."""
    world.space.refresh()
    if replicated.standby is None:
        try:
            world.space._wait([world.key(f"standby/{replicated.slot}")],
                              min(10.0, world.timeout))
        except RuntimeError:
            return
        world.space.refresh()


