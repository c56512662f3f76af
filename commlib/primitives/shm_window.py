"""The shared-memory window of a communicator's node: made collectively on first use,
one per communicator, freed with it (see :mod:`commlib.primitives.node_shm` for the
collectives that use it and for how it behaves in fault-tolerant mode and on exit)."""
from __future__ import annotations

import weakref
from time import perf_counter, sleep
from typing import Any

import numpy as np
from mpi4py import MPI

from ..base.options import options
from ..core import exits
from ..core.communicator import Communicator
from ..mpi import shutdown
from .shm_turns import Turns


class NodeWindow:
    """The shared-memory window of the ranks of one communicator's node.

    ``whole``: every rank of the communicator is in it (the flat collectives may use it).
    ``every_node``: every node of the communicator has more than one rank and a window
    (the hierarchical allreduce may use them).
    ``comm``: the window's communicator (the node's ranks, in the communicator's order;
    fault-tolerant when the mode is on). ``segments[k]``: rank ``k``'s segment as bytes,
    two halves of ``half_bytes``.
    """

    def __init__(self, comm: Any, win: Any, segments: list[np.ndarray], whole: bool,
                 poll_s: float, half_bytes: int, every_node: bool = False,
                 leaders: Any = None) -> None:
        self.comm = comm
        self.every_node = every_node  # every node of the communicator has a window
        self.leaders = leaders  # node leaders (own MPI communicator; None off the leaders)
        self.half_bytes = half_bytes  # node_shm.SEGMENT_BYTES when the window was made
        self.win = win
        self.segments = segments
        self.whole = whole
        self.poll_s = poll_s
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.step = 0
        self.freed = False
        self._views: dict[tuple, list[np.ndarray]] = {}
        #: the order of the window's collectives; runs the nonblocking ones
        self.turns = Turns(f"window of rank {self.rank}")
        #: reading a neighbour's fresh data is much slower than one's own (different
        #: last-level caches: :func:`cross_core_ratio`); the same on every rank
        self.far = False
        self.cross_ratio = 1.0

    def half(self, dtype: np.dtype, count: int) -> list[np.ndarray]:
        """Every rank's view of ``count`` elements of ``dtype`` in the next step's half."""
        h = self.step & 1
        self.step += 1
        key = (dtype, h)
        views = self._views.get(key)
        if views is None:
            lo, hi = h * self.half_bytes, (h + 1) * self.half_bytes
            views = self._views[key] = [seg[lo:hi].view(dtype) for seg in self.segments]
        return [v[:count] for v in views]

    def sync(self) -> None:
        """Barrier over the node, with the window's memory synchronized on both sides."""
        win = self.win
        win.Sync()
        if self.poll_s:
            req = self.comm.Ibarrier()
            while not req.Test():
                sleep(self.poll_s)
        else:
            self.comm.Barrier()
        win.Sync()

    def free(self) -> None:
        """Collective over the node: free the window and its communicator (kept when the
        communicator has failed, fault-tolerant mode)."""
        if self.freed:
            return
        self.freed = True
        self.turns.stop()  # nonblocking collectives issued before the free run first
        if getattr(self.comm, "failed", False) or exits.leaving():
            # MPI_Win_free is collective: a rank tearing down on an error path (Lightning's
            # teardown after sys.exit(1) destroys the process group while rank 0 trains on)
            # would wait in it forever; the process's end releases the window instead
            RETIRED.append(self)
            return
        self.segments = []
        self._views = {}
        self.win.Unlock_all()
        self.win.Free()
        self.comm.Free()
        if self.leaders is not None:
            self.leaders.Free()


#: Windows of communicators freed while this rank was leaving (:func:`commlib.core.exits.leaving`)
#: or failed: never freed (``MPI_Win_free`` is collective), kept referenced until the end.
RETIRED: list[NodeWindow] = []

_WINDOWS: weakref.WeakKeyDictionary[Communicator, NodeWindow | None] = \
    weakref.WeakKeyDictionary()


def free_at_exit() -> None:
    """At exit, after the exit agreement (:func:`commlib.mpi.shutdown.at_final`): when
    every rank ended normally, free the windows still alive, in the order they were made
    (the same on every rank: each was made collectively), so that ``MPI_Finalize`` finds
    none. A window left to ``MPI_Finalize`` made MPICH's OFI netmod fail there
    (``fabricclose ... Device or resource busy``) where ranks of one node also talk to other
    nodes over a network. After an abnormal end the process's end releases them."""
    if not exits.all_ended_normally():
        return
    for comm in list(_WINDOWS.keys()):
        nw = _WINDOWS.get(comm)
        if nw is not None and not nw.freed:
            nw.free()


def made(comm: Communicator) -> NodeWindow | None:
    """``comm``'s window if :func:`window` made one (local; None otherwise)."""
    return _WINDOWS.get(comm)


def window(comm: Communicator, half_bytes: int) -> NodeWindow | None:
    """``comm``'s node window, made on first use (collective over ``comm``: every rank
    calls it the first time together) with two halves of ``half_bytes`` per rank; None
    when this rank's node has one rank or its ranks cannot share memory. The answer of
    ``.whole`` is the same on every rank."""
    try:
        return _WINDOWS[comm]
    except KeyError:
        pass
    # collective, under the watchdog like any blocking call: a peer that left (or never
    # comes) ends the job through the exit agreement or the timeout, not a silent hang
    comm.arm("shared-memory window", "the node's shared-memory window")
    try:
        local, leaders = comm.node()
        nw = _make(comm, local, leaders, half_bytes)
    finally:
        comm.disarm()
    _WINDOWS[comm] = nw
    if nw is not None:
        comm.on_free.append(nw.free)
        shutdown.at_final(free_at_exit)  # once, after the exit agreement (registered first)
    return nw


def _make(comm: Communicator, local: Communicator, leaders: Communicator | None,
          half: int) -> NodeWindow | None:
    whole = local.size == comm.size
    # node() may be emulated (COMMLIB_LOCAL_SIZE): its ranks share memory only if one
    # shared-memory split of it keeps them all together; every rank of the communicator
    # learns whether every node can (the flat path's decision must be the same on all).
    shared = local.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=local.rank)
    ok = shared != MPI.COMM_NULL and shared.Get_size() == local.size and local.size > 1
    everyone = comm.mpi.allgather(bool(ok))
    whole = whole and all(everyone)
    # the hierarchical allreduce's leaders exchange on a communicator of their own, so
    # that its blocking calls never interleave with nonblocking ones on leaders
    lead = leaders.mpi.Dup() if leaders is not None else None
    if not ok:
        if shared != MPI.COMM_NULL:
            shared.Free()
        if lead is not None:
            lead.Free()
        return None
    info = MPI.Info.Create()
    info.Set("alloc_shared_noncontig", "true")  # each segment on its owner's pages
    try:
        if options.fault_tolerant:
            from ..fault.fault_tolerance import in_thread
            win = in_thread(shared, "Win_allocate_shared", MPI.Win.Allocate_shared,
                            2 * half, 1, info, shared)
        else:
            win = MPI.Win.Allocate_shared(2 * half, 1, info, shared)
    finally:
        info.Free()
    win.Lock_all(MPI.MODE_NOCHECK)
    segments = []
    for k in range(shared.Get_size()):
        mem, _ = win.Shared_query(k)
        segments.append(np.frombuffer(mem, dtype=np.uint8, count=2 * half))
    segments[shared.Get_rank()][:] = 0  # first touch: the pages on this rank's NUMA node
    nw = NodeWindow(shared, win, segments, whole, comm.poll_s, half, all(everyone), lead)
    nw.sync()
    nw.cross_ratio = cross_core_ratio(nw)
    nw.far = nw.cross_ratio > FAR_RATIO
    return nw


#: Bytes each rank reads in :func:`cross_core_ratio` (at most its segment).
PROBE_BYTES = 1 << 20
#: A node whose :func:`cross_core_ratio` exceeds this is *far* (``NodeWindow.far``).
FAR_RATIO = 1.4


def cross_core_ratio(nw: NodeWindow) -> float:
    """How much slower a rank reads what its neighbour just wrote than what it wrote
    itself (:data:`PROBE_BYTES` of the window, best of three; the largest ratio of the
    node's ranks, the same on every rank; collective over ``nw.comm``; about 1 ms).

    On the development VM (2 vCPUs of an AMD EPYC) it is about 1.0 in some jobs and 1.8
    in others: the host places the two vCPUs on cores that share a last-level cache or not,
    and the tier, which moves each step's data from one core's cache to the other's, ran
    a 64 MiB allreduce in 9.5-10 ms in the first case and 35-36 ms in the second, where
    MPI's own (memory-bound) took 28 ms in both (6 of 6 jobs matched; docs/benchmarks/
    collectives.md). Ranks on different sockets or chiplets of a real node are the second
    case."""
    me, n = nw.rank, nw.size
    nbytes = min(PROBE_BYTES, nw.segments[me].size)
    mine, peer = nw.segments[me][:nbytes], nw.segments[(me + 1) % n][:nbytes]
    scratch = np.empty(nbytes, np.uint8)
    local = cross = float("inf")
    for i in range(4):
        mine.fill(i + 1)  # in this core's caches now; the neighbour did the same
        nw.sync()
        t0 = perf_counter()
        np.copyto(scratch, mine)
        t1 = perf_counter()
        np.copyto(scratch, peer)
        t2 = perf_counter()
        nw.sync()
        if i:  # the first round maps the neighbour's pages
            local, cross = min(local, t1 - t0), min(cross, t2 - t1)
    return float(nw.comm.allreduce(cross / max(local, 1e-9), op=MPI.MAX))
