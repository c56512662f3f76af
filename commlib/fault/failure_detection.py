"""Failure detection for fault-tolerant mode (:mod:`commlib.fault.fault_tolerance`): which
processes of the job are dead, read by one daemon thread per process.

* :class:`LocalProcesses`: peers on this machine and in this process's pid namespace, from
  their process ids (exchanged by :func:`commlib.init`): a peer is dead once its process is
  gone, a zombie, or another process with its id. No message is involved.
* The launcher's or library's list of dead processes (:meth:`commlib.fault.ft_backend.Backend.
  detector`: ``MPIX_Comm_get_failed``, through ctypes on MPICH, where it reads hydra's
  ``PMI_dead_processes`` when ``mpiexec`` runs with ``-disable-auto-cleanup`` or the
  store-backed world of :mod:`commlib.mpi.launch`, which answers the same PMI key
  (``shared/notes/surviving-a-dead-rank.md``); ULFM's ``MPI_Comm_get_failed`` on Open MPI;
  none on Intel MPI). Read only while some peer of ``MPI_COMM_WORLD`` is not covered by
  :class:`LocalProcesses` (on another machine): each read is a call into MPI from this
  thread, on MPICH a PMI round trip, and there a rank that dies while its own read is in
  flight makes hydra's proxy fail to forward the answer ("unable to forward PMI response
  to MPI process"), after which ``mpiexec`` ends the whole job (measured: 1 of 24 4-rank
  jobs under load, when every rank polled).
* :class:`StoreDetector`: in a store-backed world, process ids on this host and heartbeats
  in the store across hosts.
* :class:`Watcher` polls every detector every :data:`POLL_S` seconds, keeps the monotone
  set of dead world ranks, and wakes the waits of fault-tolerant communicators that a new
  death concerns; other detectors can be added to :data:`SOURCES`.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from mpi4py import MPI

from . import ft_backend

#: Seconds between two reads of the launcher's list of dead processes.
POLL_S = 0.02
#: Extra failure detectors: callables returning world ranks known dead (e.g. a store-backed
#: world's monitor); read by the watcher on every poll.
SOURCES: list[Callable[[], Iterable[int]]] = []


def boot_id() -> str:
    """The running kernel's boot id: the same in every network, UTS, pid or container
    namespace of one machine, different on another machine; empty where ``/proc`` does not
    say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def this_process() -> tuple[str, str, int, int]:
    """What lets a peer of this machine watch this process: (:func:`boot_id`, the pid
    namespace, the process id, its start time in clock ticks since boot); empty strings
    where ``/proc`` does not say."""
    pid = os.getpid()
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return boot_id(), ns, pid, _start_time(pid) or 0


def _start_time(pid: int) -> int | None:
    """Start time of running process ``pid`` (clock ticks since boot); ``None`` when it
    is gone or a zombie (killed but not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[19])  # field 22 of proc(5), counted after the command name
    except (IndexError, ValueError):
        return None


class LocalProcesses:
    """Detector of the dead among the peers of this machine and pid namespace.

    ``peers`` maps each world rank (``MPI_COMM_WORLD``'s) to its :func:`this_process`
    tuple. A peer is watched when its boot id and pid namespace are this process's and its
    process, seen here, has the start time it reported (``gone_is_dead``: whatever it has
    now, for peers known alive when they reported: one that is gone already is dead); it
    counts dead from the first poll that finds that process gone, a zombie, or replaced
    (another start time)."""

    def __init__(self, peers: dict[int, tuple[str, str, int, int]], me: int,
                 world_size: int, gone_is_dead: bool = False) -> None:
        boot, ns, _, _ = this_process()
        self.me, self.world_size = me, world_size
        self.watched: dict[int, tuple[int, int]] = {}
        for rank, (b, n, pid, start) in peers.items():
            if rank == me or not boot or not ns or (b, n) != (boot, ns) or not start:
                continue
            if gone_is_dead or _start_time(pid) == start:
                self.watched[rank] = (pid, start)
        self.dead: set[int] = set()

    def covers_world(self) -> bool:
        """Whether every other rank of ``MPI_COMM_WORLD`` is watched here (then the
        launcher need not be asked)."""
        return len(self.watched) == self.world_size - 1

    def __call__(self) -> set[int]:
        for rank, (pid, start) in self.watched.items():
            if rank not in self.dead and _start_time(pid) != start:
                self.dead.add(rank)
        return self.dead


#: The detector of this machine's peers, set by :func:`watch_local` (from ``init``).
_local: LocalProcesses | None = None


def watch_local(peers: dict[int, tuple[str, str, int, int]]) -> None:
    """Watch the peers of this machine from now on (``peers``: world rank ->
    :func:`this_process` of that rank, from every rank of the job); called by
    :func:`commlib.init` after its exchange."""
    global _local
    _local = LocalProcesses(peers, MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())


class Watcher:
    """The daemon thread that reads the dead processes and interrupts waits on failed
    communicators. One per process (:func:`watcher`)."""

    def __init__(self) -> None:
        self.dead: frozenset[int] = frozenset()
        self.lock = threading.Lock()
        # wait id -> (box, comm): an FTComm's wait, woken when a death concerns comm
        self.waiting: dict[int, tuple[Any, Any]] = {}
        self.listeners: list[Callable[[frozenset], None]] = []
        self.launcher = ft_backend.backend().detector()
        self.available = self.launcher is not None
        self.polls = 0
        self.launcher_reads = 0  # polls that read self.launcher: a peer on another machine
        self.changed = threading.Condition(self.lock)
        # The "world ranks" the dead are counted in: MPI_COMM_WORLD's, until a grown world
        # (spawned ranks merged in) replaces it (see rebase).
        self.base = MPI.COMM_WORLD.Get_group()
        self.det_map: dict[int, int] | None = None  # detector rank -> base rank (None: same)
        self.epoch = 0
        self.raw_dead: set[int] = set()  # as the detectors report them
        # the grown world's peers on this machine, watched in its ranks (see watch_grown)
        self.grown: LocalProcesses | None = None
        # and on other machines, by a connection each (see watch_grown)
        self.remote: Any = None
        self.changed_at = 0.0  # time.monotonic() of the last death seen
        self._thread = threading.Thread(target=self._run, name="commlib-ft", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the watch must go on
                pass
            time.sleep(POLL_S)

    def poll(self) -> frozenset[int]:
        """Read every detector now; interrupt the waits that a new death concerns."""
        epoch = self.epoch  # (ranks read before a rebase are not the new world's)
        local = _local
        found = set() if local is None else set(local())
        if self.launcher is not None and (local is None or not local.covers_world()):
            self.launcher_reads += 1
            found.update(self.launcher())
        for source in list(SOURCES):
            try:
                found.update(int(r) for r in source())
            except Exception:  # noqa: BLE001
                pass
        self.raw_dead |= found
        found = self.to_base(found)
        grown, remote = self.grown, self.remote
        if grown is not None:
            found.update(grown())
        if remote is not None:
            found.update(remote())
        self.polls += 1
        if found <= self.dead:
            return self.dead

        with self.lock:
            if self.epoch != epoch:  # rebased meanwhile: the next poll reads again
                return self.dead
            self.dead = dead = self.dead | frozenset(found)
            self.changed_at = time.monotonic()
            for key, (box, comm) in list(self.waiting.items()):
                if dead - comm.known_dead:
                    del self.waiting[key]
                    box.event.set()
            self.changed.notify_all()
        for listener in list(self.listeners):
            try:
                listener(dead)
            except Exception:  # noqa: BLE001
                pass
        return dead

    def to_base(self, ranks: Iterable[int]) -> set[int]:
        """Ranks of this process's ``MPI_COMM_WORLD`` (what the detectors report) as ranks
        of the base world; ranks outside it are dropped."""
        m = self.det_map
        return set(ranks) if m is None else {m[r] for r in ranks if r in m}

    def rebase(self, comm: Any) -> None:
        """``comm`` (every member alive) is the world from now on (after a grow): the
        dead are counted in its ranks. Every communicator made before fails for good (a
        marker ``-epoch`` joins the dead set; newer communicators know it)."""
        group = comm.Get_group()
        mine = MPI.COMM_WORLD.Get_group()
        n = mine.Get_size()
        there = MPI.Group.Translate_ranks(mine, list(range(n)), group)
        mine.Free()
        with self.lock:
            self.det_map = {r: t for r, t in enumerate(there) if t != MPI.UNDEFINED}
            self.base = group
            self.grown = None  # (in the old world's ranks: watch_grown sets the new one)
            if self.remote is not None:
                self.remote.close()
            self.remote = None
            self.epoch += 1
            self.dead = frozenset(r for r in self.dead if r < 0) | {-self.epoch}
            for key, (box, _) in list(self.waiting.items()):
                del self.waiting[key]
                box.event.set()
            self.changed.notify_all()

    def watch_grown(self, peers: dict[int, tuple[str, str, int, int]], me: int,
                    ports: dict[int, Any] | None = None) -> None:
        """After :meth:`rebase`: watch the processes of the grown world that are in
        another ``MPI_COMM_WORLD`` than this process's: on this machine by their process
        ids (``peers``: rank of the grown world -> :func:`this_process` of that rank), on
        another machine by a TCP connection to each one's watch port (``ports``: rank ->
        :meth:`commlib.fault.peer_sockets.Listener.address`;
        :class:`~commlib.fault.peer_sockets.RemotePeers`). A process spawned into the
        world lives in another ``MPI_COMM_WORLD`` than its parents: neither their
        :class:`LocalProcesses` nor the launcher's list of dead processes (one job's)
        covers it, nor, for the newcomer, its parents; the peers of this process's own
        ``MPI_COMM_WORLD`` stay covered by the launcher's list."""
        # (a peer that died between its report and now is dead: it reported in the grow)
        local = LocalProcesses(peers, me, len(peers), gone_is_dead=True)
        remote = None
        if ports:
            mine = set((self.det_map or {}).values())
            far = {r: ports[r] for r in peers
                   if r != me and r not in local.watched and r not in mine and r in ports}
            if far:
                from .peer_sockets import RemotePeers
                remote = RemotePeers(far, me)
        self.grown, self.remote = local, remote

    def wait_change(self, known: frozenset, timeout: float) -> frozenset:
        """Block up to ``timeout`` s until the dead set is not ``known`` any more."""
        with self.lock:
            if self.dead == known:
                self.changed.wait(timeout)
            return self.dead


class StoreDetector:
    """Failure detection in a store-backed world (:mod:`commlib.mpi.launch`: torchrun-style
    environments, no ``mpiexec``): every rank publishes its host and process id in the
    job's store; a peer on this host is dead once its process is gone or a zombie (checked
    on every watcher poll), a peer on another host once its heartbeat (a counter it
    increments from the launch monitor, every :data:`commlib.mpi.launch.world.POLL_S` s) has
    not moved for :data:`STALE_S` s. Dead ranks are also added to the world's ``dead``,
    which its PMI server answers to ``MPIX_Comm_get_failed``."""

    #: Seconds without a heartbeat after which a peer on another host counts as dead.
    STALE_S = 3.0

    def __init__(self, world: Any) -> None:
        import os
        import socket
        self.world = world
        self.rank, self.size = world.rank, world.size
        self.host = socket.gethostname()
        self.peers: dict[int, tuple[str, int]] = {}
        self.beats: dict[int, tuple[int, float]] = {}
        self.dead: set[int] = set()
        world.call("set", world.key(f"ft/pid/{self.rank}"), f"{self.host} {os.getpid()}")
        world.on_poll(self._beat)

    def _beat(self, world: Any) -> None:
        """Launch monitor thread: my heartbeat, and the others' heartbeats read."""
        world.call("add", world.key(f"ft/beat/{self.rank}"), 1)
        now = time.monotonic()
        for r in range(self.size):
            if r == self.rank or r in self.dead:
                continue
            beat = int(world.call("add", world.key(f"ft/beat/{r}"), 0))
            seen = self.beats.get(r)
            if seen is None or seen[0] != beat:
                self.beats[r] = (beat, now)
            elif now - seen[1] > self.STALE_S:
                self.dead.add(r)

    def __call__(self) -> list[int]:
        # the world's own dead (a store's host whose standby took over)
        self.dead.update(r for r in list(self.world.dead) if r != self.rank)
        for r in range(self.size):
            if r == self.rank or r in self.dead:
                continue
            peer = self.peers.get(r)
            if peer is None:
                key = self.world.key(f"ft/pid/{r}")
                if not self.world.call("check", [key]):
                    continue
                host, pid = _text(self.world.call("get", key)).split()
                peer = self.peers[r] = (host, int(pid))
            if peer[0] == self.host and _start_time(peer[1]) is None:
                self.dead.add(r)
        if not self.dead <= self.world.dead:
            self.world.dead.update(self.dead)
        return list(self.dead)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


_watcher: Watcher | None = None
_watcher_lock = threading.Lock()


def watcher() -> Watcher:
    """The process's :class:`Watcher`, started on first use (with a
    :class:`StoreDetector` in a store-backed world)."""
    global _watcher
    if _watcher is None:
        with _watcher_lock:
            if _watcher is None:
                from ..mpi import launch
                world = launch.current()
                # the MPI library refuses, or cannot watch this job: CommError, every rank
                ft_backend.backend().check(_local is not None and _local.covers_world(),
                                           world is not None, MPI.COMM_WORLD.Get_size())
                if world is not None:
                    SOURCES.append(StoreDetector(world))
                _watcher = Watcher()
    return _watcher


def dead_in_world() -> frozenset[int]:
    """Ranks of this process's ``MPI_COMM_WORLD`` known dead (whatever the base world; none
    before the watcher started, e.g. on the exit path of a refused ``init``)."""
    w = _watcher
    return frozenset() if w is None else frozenset(w.raw_dead)


def dead() -> frozenset[int]:
    """World ranks known dead so far (monotone; none before the watcher started)."""
    w = _watcher
    return frozenset() if w is None else w.dead


def available() -> bool:
    """Whether the launcher's or library's list of dead processes can be read (otherwise
    only the peers of this machine and :data:`SOURCES` are watched)."""
    return watcher().available
