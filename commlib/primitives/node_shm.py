"""Collectives through shared memory among the ranks of one node (the shared-memory tier).

The ranks of a communicator that share a machine (``MPI_Comm_split_type(SHARED)``; with
``COMMLIB_LOCAL_SIZE``, the ranks of one emulated node, when they share memory too) map
one MPI-3 shared-memory window (``MPI_Win_allocate_shared``, which MPICH, Open MPI and
Intel MPI all offer): every rank owns a *segment* of ``2 x SEGMENT_BYTES`` bytes in it, two
halves used by alternate steps, and reads its peers' segments straight from their memory.
No byte goes through MPI's eager cells; MPI only synchronizes (a barrier on the window's
communicator, with ``MPI_Win_sync`` on both sides so that the stores before it are seen
after it on every memory model).

One *step* moves at most ``SEGMENT_BYTES`` bytes of a rank's buffer:

* **allreduce**: each rank copies its chunk into its segment; barrier; then at 2 ranks, or
  for chunks of at most ``WHOLE_STEP_BYTES``, every rank reduces the whole chunk from every
  segment into its own buffer; else rank ``r`` reduces its slice ``[m*r//n, m*(r+1)//n)``
  of the chunk, writing the result into rank 0's segment (the slices are disjoint, and
  only rank ``r`` reads slice ``r`` before the next barrier); barrier; every rank copies
  the whole reduced chunk out of rank 0's segment. Either way each element is reduced
  **in rank order** (``((x_0 op x_1) op x_2) ... op x_{n-1}``, the same order on every rank
  and for every element, whichever rank reduces it), so every rank ends with the same
  bytes.
* **reduce_scatter**: each rank copies, for every rank ``k``, the step's piece of block
  ``k`` into its segment; barrier; each rank reduces its own block's piece from every
  segment, in rank order, straight into its result buffer.
* **allgather**: each rank copies its chunk into its segment; barrier; each rank copies
  every segment's chunk into its row of the result.
* **broadcast**: the source copies its chunk into its segment; barrier; the others copy it.
* **hierarchical allreduce** (``hierarchical=True`` across nodes): the node's ranks reduce
  the step's chunk as in allreduce; barrier; the node leader allreduces it with the other
  leaders over MPI and puts the result back into rank 0's segment; barrier; the others
  copy it out (used when every node has more than one rank).

Consecutive steps use alternate halves, so one barrier per step separates a rank's reads
of half ``h`` at step ``t`` from its owner's next write into it at step ``t + 2`` (the
owner passes the barrier of step ``t + 1`` only after every rank finished step ``t``); the
step counter runs on across operations, so this holds between them too.

Reductions: numpy ufuncs on the host views (SUM/AVG ``add``, PRODUCT ``multiply``,
MIN/MAX ``minimum``/``maximum``, the bitwise ops; on bool SUM/MAX/BOR are logical OR,
MIN/PRODUCT/BAND logical AND, BXOR logical XOR, as on the MPI path). Integer results are
exactly the MPI path's (wrapping like it); floating-point results are the rank-order sum,
which may differ from MPI's order by reassociation only. ``bfloat16`` and ``float16`` are
widened to float32, combined in rank order in float32 and rounded to 16 bits (nearest
even) once at the end, where the MPI path rounds after each pair (equal at 2 ranks). AVG
is the SUM divided by the group size afterwards, as on the MPI path.

When it is used (:func:`use` and :func:`use_hierarchical`, called by :func:`commlib.allreduce`,
:func:`commlib.reduce_scatter`, :func:`commlib.allgather` and :func:`commlib.broadcast`):
a blocking call, or a nonblocking ``allreduce`` (``async_op=True``) of at least
:data:`ASYNC_MIN_BYTES` under ``auto`` (:func:`use_async`: thread-multiple MPI, not in
fault-tolerant mode; run by the window's thread in issue order, :mod:`.shm_turns`; the
other nonblocking collectives stay on MPI), on host memory (numpy arrays, CPU torch
tensors, and the host staging of GPU buffers), when every rank of the communicator is on
one node, and, with ``COMMLIB_SHM=auto`` (the default), when the buffer's size is in one of
the ranges of :data:`AUTO_RANGES` for that operation (and below
:data:`OVERSUBSCRIBED_MAX_BYTES` where ranks outnumber cores, and inside
:data:`FAR_RANGES` too where the node's ranks do not share a last-level cache:
``NodeWindow.far``, probed when the window is made), where it beat MPI in
``benchmarks/bench_collectives.py --shm`` against the MPI implementation in use (MPICH:
allreduce from 16 KiB to 2 MiB and from 32 MiB on, reduce_scatter from 256 KiB on; Open MPI
and Intel MPI, whose own small allreduces the tier does not beat: allreduce from 32 MiB,
reduce_scatter from 256 KiB and 64 MiB; allgather and broadcast never: MPI's single-copy
transfers move fewer bytes); ``COMMLIB_SHM=1`` takes it at any size, ``COMMLIB_SHM=0``
never. The decision depends only
on what every rank passes alike (size, dtype, kind of memory), so every rank takes the same
path; ``COMMLIB_SHM`` must be set alike on every rank.

The window is made collectively on first use, per communicator, and freed by
:meth:`Communicator.free`; ranks that finish normally leave the rest to ``MPI_Finalize``.
MPICH unlinks the window's ``/dev/shm`` file once every rank has mapped it (Open MPI and
Intel MPI likewise), so nothing is left there after a killed job.

Fault-tolerant mode (``COMMLIB_FAULT_TOLERANT=1``): the window's communicator is a
fault-tolerant one, so each barrier is an ``MPI_Ibarrier`` waited on with failure
detection; a peer that dies mid-collective makes every survivor's next barrier raise
:class:`~commlib.base.errors.PeerFailure` (no rank ever spins on a flag in memory). A dead
peer's segment stays mapped (the kernel keeps the memory while any rank maps it), so the
survivors' reads never fault; the window of a failed communicator is never freed
(``MPI_Win_free`` is collective), like its communicators.
"""
from __future__ import annotations

from time import perf_counter, sleep
from typing import Any

import numpy as np
from mpi4py import MPI

from ..base import accounting
from ..base.buffers import Buf
from ..base.errors import CommError, where
from ..base.options import options
from ..base.reduce_ops import ReduceOp
from ..core import runtime
from ..core.communicator import Communicator
from ..mpi import mpi_impl
from . import shm_window
from ._base import finish_reduce
from .shm_reduce import Combine, combiner
from .shm_window import RETIRED, NodeWindow

__all__ = ["AUTO_RANGES", "COUNTS", "HIERARCHICAL_MAX_BYTES", "MPICH_AUTO_RANGES", "RETIRED",
           "SEGMENT_BYTES", "WHOLE_STEP_BYTES", "NodeWindow", "allgather", "allreduce",
           "allreduce_from", "auto", "broadcast",
           "combiner", "hierarchical_allreduce", "reduce_all", "reduce_scatter", "use",
           "use_hierarchical", "window"]

#: Bytes of one half of a rank's segment: the most one step moves per rank (the window
#: holds 2 x this per rank). 1 MiB: at 2 ranks the step's working set stays in the L2/L3
#: caches.
SEGMENT_BYTES = 1 << 20
#: With ``COMMLIB_SHM=auto``: per operation, the ``[low, high)`` buffer sizes (bytes per
#: rank; ``high`` None: no bound) it takes through shared memory. Measured at 2 ranks on
#: the development machine with MPICH 5.0.2 on a quiet machine (docs/benchmarks/collectives.md,
#: "Shared memory inside a node"): allreduce wins from 16 KiB (one barrier and two copies
#: against MPI's protocol) to 1 MiB, loses from 2 to 16 MiB where MPI's buffers stay in
#: the 32 MiB L3 and its single-copy transfers move fewer bytes, and wins 3x at 64 MiB
#: (MPI falls to 2.4 GB/s busbw out of the cache, the tier keeps its 1 MiB steps in it);
#: reruns on 2026-12-05 (quiet, 4 runs; results/collectives_shm_range_n2_mpich*.json):
#: 16 MiB 1.04-1.17x, 25 MiB 1.17-1.22x in 2 runs but 0.38-0.40x (median; best 0.38-1.03)
#: in the other 2 (the tier's slow mode: ranks without a shared cache, see
#: :data:`FAR_RANGES`), 32-64 MiB 2.8-3.1x in all: the second range starts at 32 MiB;
#: reduce_scatter wins 1.4-3.8x from 256 KiB on; allgather and broadcast never win at 2
#: ranks (MPI's single-copy transfers: one copy per byte against the tier's two).
#: Each operation's ranges are in ascending order (auto() stops below the first).
#: Other MPI implementations measure differently (their own shared-memory collectives):
#: their overrides come from :attr:`commlib.mpi.mpi_impl.Implementation.shm_auto_ranges`
#: at import (:data:`MPICH_AUTO_RANGES` keeps MPICH's).
MPICH_AUTO_RANGES: dict[str, tuple[tuple[int, int | None], ...]] = {
    "allreduce": ((16 << 10, 2 << 20), (32 << 20, None)),
    "reduce_scatter": ((256 << 10, None),),
    "allgather": (),
    "broadcast": (),
}
AUTO_RANGES: dict[str, tuple[tuple[int, int | None], ...]] = {
    **MPICH_AUTO_RANGES, **dict(mpi_impl.current(MPI).shm_auto_ranges)}
#: Under ``COMMLIB_SHM=auto`` on a *far* node (``NodeWindow.far``: its ranks' caches are
#: not shared, :func:`commlib.primitives.shm_window.cross_core_ratio`), the flat collectives
#: take the tier only where these ranges allow it too (intersected with
#: :data:`AUTO_RANGES`). Measured at 2 ranks with MPICH in that mode (4 jobs, the tier
#: against MPI): allreduce 1.01-1.07x up to 1 MiB, 0.55-0.99x from 2 MiB, 0.79-0.94x at
#: 32-64 MiB; reduce_scatter 1.08-1.34x at 256 KiB, 0.31-0.56x from 1 to 32 MiB.
FAR_RANGES: dict[str, tuple[tuple[int, int | None], ...]] = {
    "allreduce": ((16 << 10, 2 << 20),),
    "reduce_scatter": ((256 << 10, 1 << 20),),
    "allgather": (),
    "broadcast": (),
}
#: Allreduce steps of at most this many bytes are reduced whole by every rank (one barrier
#: instead of two; see :func:`reduce_all`).
WHOLE_STEP_BYTES = 64 << 10
#: With ``COMMLIB_SHM=auto``, the hierarchical allreduce takes its node tier through shared
#: memory below this size only: from 2 MiB on the MPI path pipelines its chunks (the node
#: steps of one chunk overlap the leaders' allreduce of another, commlib.primitives.
#: allreduce), which this tier does not; not measured across real nodes yet.
HIERARCHICAL_MAX_BYTES = 2 << 20
#: With ``COMMLIB_SHM=auto`` on a host whose ranks outnumber its cores (the waits poll and
#: sleep: ``Communicator.poll_s``), the flat collectives take the tier below this size only:
#: at 4 ranks on 2 cores its barriers' sleeps made 32 and 64 MiB allreduces 1.4-1.5x slower
#: than MPI's, while up to 1 MiB it still beat commlib's MPI path (two runs,
#: ``benchmarks/results/collectives_shm_n4_mpich*.json``).
OVERSUBSCRIBED_MAX_BYTES = 4 << 20
#: With ``COMMLIB_SHM=auto``, nonblocking collectives take the tier from this size on
#: (:func:`use_async`); below it the hand-over to the window's thread costs more than the
#: tier gains.
ASYNC_MIN_BYTES = 4 << 20
#: Calls completed through shared memory, per operation, in this process (tests and
#: benchmarks read it to know which path ran).
COUNTS = {"allreduce": 0, "reduce_scatter": 0, "allgather": 0, "broadcast": 0,
          "hierarchical": 0, "async": 0}


def window(comm: Communicator) -> NodeWindow | None:
    """``comm``'s node window (:func:`commlib.primitives.shm_window.window`), made on first
    use with segments of ``2 x`` :data:`SEGMENT_BYTES` (collective over ``comm`` the first
    time); None when this rank's node has one rank or its ranks cannot share memory."""
    return shm_window.window(comm, SEGMENT_BYTES)


def auto(op: str, nbytes: int) -> bool:
    """Whether ``COMMLIB_SHM=auto`` takes ``op`` of ``nbytes`` bytes per rank through
    shared memory (:data:`AUTO_RANGES`; a far node also needs :data:`FAR_RANGES`)."""
    return _within(AUTO_RANGES[op], nbytes)


def _within(ranges: tuple[tuple[int, int | None], ...], nbytes: int) -> bool:
    if not ranges or nbytes < ranges[0][0]:  # below the first range (small messages)
        return False
    for low, high in ranges:
        if nbytes >= low and (high is None or nbytes < high):
            return True
    return False


def use_hierarchical(comm: Communicator, buf: Buf) -> bool:
    """Whether the blocking hierarchical allreduce of ``buf`` takes its node tier through
    shared memory (:func:`hierarchical_allreduce`): as :func:`use`, when every node of
    ``comm`` has more than one rank, sharing memory; with ``COMMLIB_SHM=auto`` only below
    :data:`HIERARCHICAL_MAX_BYTES`. The same answer on every rank."""
    setting = options.shm
    if setting == "0" or comm.size < 2 or buf.mem.__class__ is not np.ndarray:
        return False
    nbytes = buf.count * buf.dt.itemsize
    if setting == "auto" and not (auto("allreduce", nbytes) and
                                  nbytes < HIERARCHICAL_MAX_BYTES):
        return False
    nw = window(comm)
    return nw is not None and nw.every_node


def use(comm: Communicator, buf: Buf, op: str) -> bool:
    """Whether the blocking collective ``op`` on ``buf`` goes through shared memory (see
    the module docstring); collective over ``comm`` the first time it answers after the
    size test (it makes the window). The same answer on every rank."""
    setting = options.shm
    if setting == "0" or comm.size < 2 or buf.mem.__class__ is not np.ndarray:
        return False
    if setting == "auto":
        nbytes = buf.count * buf.dt.itemsize
        if not auto(op, nbytes) or (comm.poll_s and nbytes >= OVERSUBSCRIBED_MAX_BYTES):
            return False
        nw = window(comm)
        return nw is not None and nw.whole and not (nw.far and
                                                    not _within(FAR_RANGES[op], nbytes))
    nw = window(comm)
    return nw is not None and nw.whole


def use_async(comm: Communicator, buf: Buf, op: str) -> bool:
    """Whether the nonblocking (``async_op=True``) collective ``op`` on ``buf`` goes
    through shared memory, run by the window's thread (:mod:`.shm_turns`): as
    :func:`use`, from :data:`ASYNC_MIN_BYTES` on (with ``COMMLIB_SHM=auto``; below it the
    hand-over to a thread costs more than the tier gains), when the MPI library is
    thread-multiple, and not in fault-tolerant mode (whose failure detection covers the
    calling thread's waits). The same answer on every rank."""
    if options.shm == "auto" and buf.count * buf.dt.itemsize < ASYNC_MIN_BYTES:
        return False
    if options.fault_tolerant or not runtime.thread_multiple():
        return False
    return use(comm, buf, op)


# -- the collectives -----------------------------------------------------------------------

class _Timed:
    """Around one call: its turn among the window's collectives (:mod:`.shm_turns`), the
    watchdog's deadline, the op's time and timeline event."""
    __slots__ = ("comm", "op", "what", "turns", "ticket", "t0")

    def __init__(self, comm: Communicator, op: str, what: Any, nw: NodeWindow) -> None:
        self.comm, self.op, self.what, self.turns = comm, op, what, nw.turns

    def __enter__(self) -> None:
        self.ticket = self.turns.enter()
        self.comm.arm(self.op, self.what)
        self.t0 = perf_counter()

    def __exit__(self, *exc: Any) -> None:
        t1 = perf_counter()
        self.comm.disarm()
        self.turns.leave(self.ticket)
        accounting.timed(self.op, self.t0, t1, self.comm, self.what, self.comm.seq)


def _node(comm: Communicator, op: str) -> NodeWindow:
    nw = shm_window.made(comm)
    if nw is None or not nw.whole:
        raise CommError(f"{where(op, comm.rank)}: the shared-memory path needs every rank "
                        f"of {comm.describe()} on one node (commlib.primitives.node_shm.use "
                        f"answers whether it is)")
    return nw


def allreduce(comm: Communicator, buf: Buf, op: ReduceOp, result: Any) -> Any:
    """Blocking allreduce of ``buf`` (host memory, in place) through the node's window;
    every rank of ``comm`` on one node (:func:`use` said so). Returns ``result``. Every
    rank ends with the same bytes: each element reduced in rank order (module docstring),
    AVG divided by the group size after."""
    nw = _node(comm, "allreduce")
    accounting.record("allreduce", buf.nbytes, comm.size)
    with _Timed(comm, "allreduce", buf, nw):
        reduce_all(nw, buf.mem.reshape(-1), combiner(op, buf.dt))
    finish_reduce(buf, op, comm.size)
    COUNTS["allreduce"] += 1
    return result


def start_allreduce(comm: Communicator, buf: Buf, op: ReduceOp, result: Any) -> Any:
    """Nonblocking :func:`allreduce` (:func:`use_async` said so): issued now, run by the
    window's thread in issue order; a handle whose ``wait()`` returns ``result``. The
    caller must not touch ``buf`` until then."""
    nw = _node(comm, "allreduce")
    accounting.record("allreduce", buf.nbytes, comm.size)
    combine = combiner(op, buf.dt)

    def run() -> Any:
        with _Timed(comm, "allreduce", buf, nw):
            reduce_all(nw, buf.mem.reshape(-1), combine)
        finish_reduce(buf, op, comm.size)
        COUNTS["allreduce"] += 1
        COUNTS["async"] += 1
        return result
    return nw.turns.submit("allreduce", run)


def allreduce_from(comm: Communicator, pieces: list[np.ndarray], buf: Buf, op: ReduceOp,
                   result: Any) -> Any:
    """Blocking allreduce of the concatenation of ``pieces`` (1-D host arrays of ``buf``'s
    dtype) into ``buf`` (host memory, 1-D) through the node's window, as :func:`allreduce`
    but with each step's segment filled straight from the pieces it spans: one copy per
    byte instead of a copy into ``buf`` and another into the segment. A piece that is a
    slice of ``buf`` must be the slice at its own offset. Returns ``result``."""
    nw = _node(comm, "allreduce")
    accounting.record("allreduce", buf.nbytes, comm.size)
    with _Timed(comm, "allreduce", buf, nw):
        reduce_all(nw, buf.mem.reshape(-1), combiner(op, buf.dt), _gather(pieces))
    finish_reduce(buf, op, comm.size)
    COUNTS["allreduce"] += 1
    return result


def _gather(pieces: list[np.ndarray]) -> Any:
    """``fill(segment, s, m)``: elements ``[s, s + m)`` of the pieces' concatenation into
    ``segment[:m]``."""
    bounds = []
    offset = 0
    for piece in pieces:
        bounds.append((offset, offset + piece.size, piece))
        offset += piece.size

    def fill(segment: np.ndarray, s: int, m: int) -> None:
        e = s + m
        for lo, hi, piece in bounds:
            if hi <= s or lo >= e:
                continue
            a, b = max(lo, s), min(hi, e)
            np.copyto(segment[a - s:b - s], piece[a - lo:b - lo])

    return fill


def reduce_all(nw: NodeWindow, x: np.ndarray, combine: Combine,
               fill: Any = None) -> None:
    """Allreduce of the 1-D contiguous host array ``x`` over ``nw``'s ranks, in place (no
    AVG division), in steps of at most ``nw.half_bytes``: at 2 ranks, or for steps of at
    most :data:`WHOLE_STEP_BYTES`, every rank reduces the whole step from every segment
    into ``x`` itself (one barrier; at 2 ranks this moves fewer bytes than splitting:
    5 instead of 5.5 times the step), else each its slice into rank 0's segment and every
    rank copies the result out (two barriers). Either way every element is combined in
    rank order, so every rank ends with the same bytes. ``fill(segment, s, m)``, when
    given, puts this rank's elements ``[s, s + m)`` into its segment instead of ``x``."""
    n, me = nw.size, nw.rank
    per = nw.half_bytes // x.itemsize
    total = x.size
    for s in range(0, total, per):
        m = min(per, total - s)
        segs = nw.half(x.dtype, m)
        if fill is None:
            np.copyto(segs[me], x[s:s + m])
        else:
            fill(segs[me], s, m)
        nw.sync()
        if n == 2 or m * x.itemsize <= WHOLE_STEP_BYTES:
            combine(x[s:s + m], segs)
            continue
        lo, hi = m * me // n, m * (me + 1) // n
        if hi > lo:
            combine(segs[0][lo:hi], [seg[lo:hi] for seg in segs])
        nw.sync()
        np.copyto(x[s:s + m], segs[0])


def hierarchical_allreduce(comm: Communicator, buf: Buf, op: ReduceOp, mop: Any,
                           result: Any) -> Any:
    """Blocking hierarchical allreduce of ``buf`` (host memory, in place) with its node
    tier through shared memory (:func:`use_hierarchical` said so): per step, the node's
    ranks reduce the step's chunk in the window as :func:`reduce_all` does (rank order
    inside the node), the node leader (local rank 0) allreduces it with the other nodes'
    leaders over MPI (``mop``) and puts the result back in the window, and every rank of
    the node copies it out (three barriers per step). Returns ``result``; every rank ends
    with the same bytes."""
    nw = shm_window.made(comm)
    if nw is None or not nw.every_node:
        raise CommError(f"{where('allreduce', comm.rank)}: the shared-memory node tier "
                        f"needs a window on every node of {comm.describe()}")
    accounting.record("allreduce", buf.nbytes, comm.size)
    combine = combiner(op, buf.dt)
    x = buf.mem.reshape(-1)
    n, me = nw.size, nw.rank
    lead = nw.leaders
    mpi_type = buf.dt.mpi
    per = nw.half_bytes // x.itemsize
    total = x.size
    with _Timed(comm, "allreduce", buf, nw):
        for s in range(0, total, per):
            m = min(per, total - s)
            segs = nw.half(x.dtype, m)
            np.copyto(segs[me], x[s:s + m])
            nw.sync()
            lo, hi = m * me // n, m * (me + 1) // n
            if hi > lo:
                combine(segs[0][lo:hi], [seg[lo:hi] for seg in segs])
            nw.sync()
            if lead is not None and lead.Get_size() > 1:
                piece = x[s:s + m]
                np.copyto(piece, segs[0])
                if nw.poll_s:
                    req = lead.Iallreduce(MPI.IN_PLACE, [piece, m, mpi_type], mop)
                    while not req.Test():
                        sleep(nw.poll_s)
                else:
                    lead.Allreduce(MPI.IN_PLACE, [piece, m, mpi_type], mop)
                np.copyto(segs[0], piece)
            nw.sync()
            if lead is None or lead.Get_size() == 1:
                np.copyto(x[s:s + m], segs[0])
    finish_reduce(buf, op, comm.size)
    COUNTS["hierarchical"] += 1
    return result


def reduce_scatter(comm: Communicator, buf: Buf, out: Buf, op: ReduceOp,
                   counts: tuple[int, ...]) -> Any:
    """Blocking reduce_scatter through the node's window: ``out`` (this rank's block,
    ``counts[rank]`` elements at the offset of the blocks before it) gets the rank-order
    reduction of every rank's ``buf``. Returns ``out.obj``."""
    nw = _node(comm, "reduce_scatter")
    n, me = nw.size, nw.rank
    accounting.record("reduce_scatter", buf.nbytes, comm.size)
    combine = combiner(op, buf.dt)
    x = buf.mem.reshape(-1)
    y = out.mem.reshape(-1)
    offsets = [sum(counts[:k]) for k in range(n)]
    per = max(1, nw.half_bytes // x.itemsize // n)  # elements of each block per step
    with _Timed(comm, "reduce_scatter", buf, nw):
        for s in range(0, max(counts, default=0), per):
            segs = nw.half(x.dtype, n * per)
            mine = segs[me]
            for k in range(n):
                m = min(per, counts[k] - s)
                if m > 0:
                    np.copyto(mine[k * per:k * per + m], x[offsets[k] + s:offsets[k] + s + m])
            nw.sync()
            m = min(per, counts[me] - s)
            if m > 0:
                combine(y[s:s + m], [seg[me * per:me * per + m] for seg in segs])
    buf.finish()
    finish_reduce(out, op, comm.size)
    COUNTS["reduce_scatter"] += 1
    return out.obj


def allgather(comm: Communicator, buf: Buf, out: Buf) -> Any:
    """Blocking allgather through the node's window: row ``k`` of ``out`` (``comm.size``
    rows of ``buf``'s elements) gets rank ``k``'s ``buf``. Returns ``out.obj``."""
    nw = _node(comm, "allgather")
    n, me = nw.size, nw.rank
    accounting.record("allgather", buf.nbytes, comm.size)
    x = buf.mem.reshape(-1)
    total = x.size
    y = out.mem.reshape(n, total)
    per = nw.half_bytes // x.itemsize
    with _Timed(comm, "allgather", buf, nw):
        for s in range(0, total, per):
            m = min(per, total - s)
            segs = nw.half(x.dtype, m)
            np.copyto(segs[me], x[s:s + m])
            nw.sync()
            for k in range(n):
                np.copyto(y[k, s:s + m], segs[k])
    buf.finish()
    out.finish()
    COUNTS["allgather"] += 1
    return out.obj


def broadcast(comm: Communicator, buf: Buf, src: int, result: Any) -> Any:
    """Blocking broadcast of rank ``src``'s ``buf`` into every rank's ``buf`` through the
    node's window (``src`` only reads its buffer). Returns ``result``."""
    nw = _node(comm, "broadcast")
    accounting.record("broadcast", buf.nbytes, comm.size)
    x = buf.mem.reshape(-1)
    total = x.size
    per = nw.half_bytes // x.itemsize
    root = nw.rank == src
    with _Timed(comm, "broadcast", buf, nw):
        for s in range(0, total, per):
            m = min(per, total - s)
            segs = nw.half(x.dtype, m)
            if root:
                np.copyto(segs[src], x[s:s + m])
            nw.sync()
            if not root:
                np.copyto(x[s:s + m], segs[src])
    buf.finish()
    COUNTS["broadcast"] += 1
    return result
