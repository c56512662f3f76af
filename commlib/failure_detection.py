"""Failure detection for fault-tolerant mode (:mod:`commlib.fault_tolerance`): which
processes of the job are dead, read by one daemon thread per process.

* ``MPIX_Comm_get_failed`` (through ctypes, :class:`_Mpix`) reads the launcher's list of
  dead processes: hydra's ``PMI_dead_processes`` when ``mpiexec`` runs with
  ``-disable-auto-cleanup``, or the store-backed world of :mod:`commlib.launch`, which
  answers the same PMI key (``shared/notes/surviving-a-dead-rank.md``).
* :class:`StoreDetector`: in a store-backed world, process ids on this host and heartbeats
  in the store across hosts.
* :class:`Watcher` polls every detector every :data:`POLL_S` seconds (one PMI round trip,
  0.2-0.5 ms), keeps the monotone set of dead world ranks, and wakes the waits of
  fault-tolerant communicators that a new death concerns; other detectors can be added to
  :data:`SOURCES`.
"""
from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, Callable, Iterable

from mpi4py import MPI

#: Seconds between two reads of the launcher's list of dead processes.
POLL_S = 0.02
#: Extra failure detectors: callables returning world ranks known dead (e.g. a store-backed
#: world's monitor); read by the watcher on every poll.
SOURCES: list[Callable[[], Iterable[int]]] = []


class _Mpix:
    """``MPIX_Comm_get_failed(MPI_COMM_WORLD)`` through ctypes, as world ranks."""

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
        group = MPI.Group.fromhandle(handle.value)
        try:
            n = group.Get_size()
            return list(MPI.Group.Translate_ranks(group, list(range(n)), self.world)) if n else []
        finally:
            group.Free()


class Watcher:
    """The daemon thread that reads the dead processes and interrupts waits on failed
    communicators. One per process (:func:`watcher`)."""

    def __init__(self) -> None:
        self.dead: frozenset[int] = frozenset()
        self.lock = threading.Lock()
        # wait id -> (box, comm): an FTComm's wait, woken when a death concerns comm
        self.waiting: dict[int, tuple[Any, Any]] = {}
        self.listeners: list[Callable[[frozenset], None]] = []
        self.mpix = _Mpix()
        self.available = self.mpix.fn is not None
        self.polls = 0
        self.changed = threading.Condition(self.lock)
        # The "world ranks" the dead are counted in: MPI_COMM_WORLD's, until a grown world
        # (spawned ranks merged in) replaces it (see rebase).
        self.base = MPI.COMM_WORLD.Get_group()
        self.det_map: dict[int, int] | None = None  # detector rank -> base rank (None: same)
        self.epoch = 0
        self.raw_dead: set[int] = set()  # as the detectors report them
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
        found = set(self.mpix())
        for source in list(SOURCES):
            try:
                found.update(int(r) for r in source())
            except Exception:  # noqa: BLE001
                pass
        self.raw_dead |= found
        found = self.to_base(found)
        self.polls += 1
        if found <= self.dead:
            return self.dead

        with self.lock:
            self.dead = dead = self.dead | frozenset(found)
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
            self.epoch += 1
            self.dead = frozenset(r for r in self.dead if r < 0) | {-self.epoch}
            for key, (box, _) in list(self.waiting.items()):
                del self.waiting[key]
                box.event.set()
            self.changed.notify_all()

    def wait_change(self, known: frozenset, timeout: float) -> frozenset:
        """Block up to ``timeout`` s until the dead set is not ``known`` any more."""
        with self.lock:
            if self.dead == known:
                self.changed.wait(timeout)
            return self.dead


class StoreDetector:
    """Failure detection in a store-backed world (:mod:`commlib.launch`: torchrun-style
    environments, no ``mpiexec``): every rank publishes its host and process id in the
    job's store; a peer on this host is dead once its process is gone or a zombie (checked
    on every watcher poll), a peer on another host once its heartbeat (a counter it
    increments from the launch monitor, every :data:`commlib.launch.world.POLL_S` s) has
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
            if peer[0] == self.host and not _alive(peer[1]):
                self.dead.add(r)
        if not self.dead <= self.world.dead:
            self.world.dead.update(self.dead)
        return list(self.dead)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


_watcher: Watcher | None = None
_watcher_lock = threading.Lock()


def watcher() -> Watcher:
    """The process's :class:`Watcher`, started on first use (with a
    :class:`StoreDetector` in a store-backed world)."""
    global _watcher
    if _watcher is None:
        with _watcher_lock:
            if _watcher is None:
                from . import launch
                world = launch.current()
                if world is not None:
                    SOURCES.append(StoreDetector(world))
                _watcher = Watcher()
    return _watcher


def dead_in_world() -> frozenset[int]:
    """Ranks of this process's ``MPI_COMM_WORLD`` known dead (whatever the base world)."""
    return frozenset(watcher().raw_dead)


def dead() -> frozenset[int]:
    """World ranks known dead so far (monotone)."""
    return watcher().dead


def available() -> bool:
    """Whether ``MPIX_Comm_get_failed`` can be called (otherwise only :data:`SOURCES`
    detect failures)."""
    return watcher().available
