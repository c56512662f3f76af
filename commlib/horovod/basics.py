"""Horovod's basics on commlib: ``init``/``shutdown``, ranks and sizes, build flags, the
timeline.

``init(comm=None, process_sets=None)``: ``comm`` is ``None`` (the MPI world), a list of
world ranks (the Horovod world is made of those ranks; only they call ``init``) or an
mpi4py communicator (it becomes commlib's world when commlib is not initialized yet, as
``commlib.init(comm)``). Calling ``init`` again after ``shutdown`` starts afresh.
``HOROVOD_TIMELINE=path`` records commlib's timeline from ``init`` on (``DYNAMIC``: only
between ``start_timeline`` and ``stop_timeline``).
"""
from __future__ import annotations

import atexit
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core import runtime
from ..primitives import allgather, group_from_ranks, world
from ..services import timeline
from . import state
from .process_sets import ProcessSet, global_process_set, register


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Initialize Horovod (idempotent while initialized). Collective over the Horovod
    world. ``process_sets``: ProcessSet objects to register now, or ``"dynamic"`` (sets
    ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` for :func:`add_process_set`)."""
    if state.current is not None:
        return
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"commlib.horovod.init: argument 'process_sets' must be a list "
                             f"of ProcessSet or 'dynamic', got {process_sets!r}")
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
        process_sets = []
    process_sets = list(process_sets or [])
    if comm is None or isinstance(comm, (list, tuple, range)):
        runtime.init()
        group = world()
        if comm is not None and list(comm) != list(range(group.size)):
            ranks = [int(r) for r in comm]
            if any(isinstance(ps, ProcessSet) and ps.mpi_comm is not None
                   for ps in process_sets):
                raise NotImplementedError(
                    "At this time process sets defined via MPI communicators are only "
                    "supported when calling hvd.init() with comm set to a global MPI "
                    "communicator.")
            group = group_from_ranks(ranks)  # members only, like Horovod's rank list
    else:
        if not hasattr(comm, "Get_size"):
            raise ValueError("Invalid type of argument comm. Expected list of rank integers "
                             "or mpi4py.MPI.Comm object.")
        runtime.init(comm=comm)   # commlib's world is this communicator (or raises)
        group = world()
    local, _ = group.comm.node()
    info = np.array([group.rank, local.rank, local.size], dtype=np.int64)
    table = allgather(info, group=group)
    same_local = [int(r) for r, lr, _ in table if lr == local.rank]
    st = state.State(group, local.rank, local.size, same_local.index(group.rank),
                     len(same_local), len(set(int(x) for x in table[:, 2])) == 1)
    state.current = st
    global_process_set.ranks = list(range(group.size))
    from .controller import Controller
    st.process_sets[0] = global_process_set
    st.controllers[0] = Controller(st, global_process_set.ranks, "horovod")
    try:
        for i, ps in enumerate(process_sets):
            if not isinstance(ps, ProcessSet):
                raise ValueError(f"commlib.horovod.init: process_sets entry number {i} is "
                                 f"not a ProcessSet: {ps!r}")
            try:
                register(ps, "init")
            except ValueError:
                raise ValueError(f"Horovod could not be initialized because process_sets entry "
                                 f"number {i} is a duplicate: {ps}") from None
    except BaseException:
        shutdown()
        raise
    tl = os.environ.get("HOROVOD_TIMELINE")
    if tl and tl.upper() != "DYNAMIC":
        start_timeline(tl)
    atexit.register(shutdown)


def shutdown() -> None:
    """Shut Horovod down: every controller finishes its round (collective over each
    process set; pending operations fail with ``HorovodInternalError``). Idempotent."""
    st = state.current
    if st is None:
        return
    try:
        for pid in sorted(st.controllers, reverse=True):
            st.controllers[pid].close()
    finally:
        _forget(st)


def abandon() -> None:
    """Forget the Horovod world after a peer died (:mod:`commlib.horovod.elastic`): no
    collective (its communicators failed); pending operations fail with
    ``HorovodInternalError``; negotiation threads stop."""
    st = state.current
    if st is None:
        return
    try:
        for ctrl in st.controllers.values():
            ctrl.abandon()
    finally:
        _forget(st)


def _forget(st) -> None:
    """The end of :func:`shutdown` and :func:`abandon`: the process sets are invalid and no
    handle is known any more."""
    for ps in st.process_sets.values():
        if ps is not global_process_set:
            ps._invalidate()
    state.current = None
    from .controller import forget_handles
    forget_handles()


def is_initialized() -> bool:
    return state.current is not None


def size() -> int:
    """Number of Horovod processes."""
    return state.require("size").size


def rank() -> int:
    """This process's Horovod rank."""
    return state.require("rank").rank


def local_size() -> int:
    """Number of Horovod processes on this node (commlib's node: shared memory, or
    ``COMMLIB_LOCAL_SIZE`` blocks)."""
    return state.require("local_size").local_size


def local_rank() -> int:
    return state.require("local_rank").local_rank


def cross_size() -> int:
    """Number of nodes that have a process of this process's local rank."""
    return state.require("cross_size").cross_size


def cross_rank() -> int:
    """This process's index among the processes of its local rank (its node's index)."""
    return state.require("cross_rank").cross_rank


def is_homogeneous() -> bool:
    """Whether every node runs the same number of processes."""
    return state.require("is_homogeneous").homogeneous


def mpi_threads_supported() -> bool:
    """Whether MPI provides ``MPI_THREAD_MULTIPLE`` (commlib then negotiates and
    exchanges on background threads)."""
    state.require("mpi_threads_supported")
    return runtime.thread_multiple()


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    """0: commlib moves CUDA tensors through MPI (CUDA-aware or staged), never NCCL."""
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """Whether CUDA tensors are supported here (torch has CUDA; commlib stages them)."""
    import torch
    return bool(torch.cuda.is_available()) and torch.version.hip is None


def rocm_built() -> bool:
    import torch
    return bool(torch.cuda.is_available()) and torch.version.hip is not None


_timeline_path: str | None = None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record commlib's timeline (collective over the world). Each rank writes
    ``file_path.rank<r>.json``; :func:`stop_timeline` merges them into ``file_path`` on
    rank 0. Needs ``HOROVOD_TIMELINE`` set (``DYNAMIC`` or a path), as Horovod does."""
    global _timeline_path
    state.require("start_timeline")
    if not os.environ.get("HOROVOD_TIMELINE"):
        raise ValueError("Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.")
    if _timeline_path is not None:
        stop_timeline()
    timeline.start(str(file_path))
    _timeline_path = str(file_path)


def stop_timeline() -> None:
    """Stop recording; rank 0 merges every rank's file into the path given to
    :func:`start_timeline` (ranks on other nodes: their own files stay)."""
    global _timeline_path
    st = state.require("stop_timeline")
    path, _timeline_path = _timeline_path, None
    timeline.stop()
    if path is None:
        return
    from ..primitives import barrier
    barrier(group=st.group)
    if st.rank == 0:
        files = [timeline.rank_path(path, r) for r in range(st.size)]
        timeline.merge([f for f in files if os.path.exists(f)], path)
