"""Horovod's process sets: named subsets of the Horovod world that run collectives together.

A :class:`ProcessSet` is built from a list of ranks (of the Horovod world, sorted as
Horovod sorts them) or an mpi4py communicator; it becomes usable once ``hvd.init(...,
process_sets=[...])`` or :func:`add_process_set` registered it, which is collective over
the whole Horovod world (every rank calls it with the same ranks, as in Horovod). Each
registered set has its own negotiation controller (:mod:`commlib.horovod.controller`) over a
commlib group of its members; ``process_set_id`` 0 is :data:`global_process_set`.
Ranks given to ops (``root_rank`` of a broadcast) stay Horovod-world ranks, as in Horovod;
:meth:`ProcessSet.rank` is the rank within the set.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from . import state


class ProcessSet:
    """A set of Horovod processes (``ranks``: world ranks, sorted) that run collectives
    together. ``process_set_id`` is ``None`` until the set is registered."""

    process_set_id: int | None = None
    ranks: list | None = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Any) -> None:
        if hasattr(ranks_or_comm, "Get_size") and hasattr(ranks_or_comm, "allgather"):
            self.mpi_comm = ranks_or_comm  # resolved to ranks when registered
            return
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process ranks or "
                             "an mpi4py Comm object") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or "
                             "an mpi4py Comm object")
        self.ranks = ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> int | None:
        """Number of processes in the set (``None`` if not registered)."""
        if self.process_set_id is None:
            return None
        return len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set (``None`` if not registered;
        ``ValueError`` on a process outside the set)."""
        if self.process_set_id is None:
            return None
        me = state.require("ProcessSet.rank").rank
        if me not in self.ranks:
            raise ValueError(f"commlib.horovod.ProcessSet.rank (rank {me}): this process is "
                             f"not a member of {self}")
        return self.ranks.index(me)

    def included(self) -> bool | None:
        """Whether this process belongs to the set (``None`` if it has no ranks yet)."""
        if self.ranks is None:
            return None
        return state.require("ProcessSet.included").rank in self.ranks

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _resolve_ranks(ps: ProcessSet) -> None:
    if ps.ranks is None and ps.mpi_comm is not None:
        # Collective over the communicator's members (the user's own communicator).
        ps.ranks = sorted(ps.mpi_comm.allgather(state.require("ProcessSet").rank))


def register(ps: ProcessSet, what: str) -> ProcessSet:
    """Collective over the Horovod world: give ``ps`` an id and a controller."""
    st = state.require(what)
    _resolve_ranks(ps)
    n = st.size
    bad = [r for r in ps.ranks if not 0 <= r < n]
    if bad or not ps.ranks or len(set(ps.ranks)) != len(ps.ranks):
        raise ValueError(f"commlib.horovod.{what} (rank {st.rank}): {ps} must hold distinct "
                         f"ranks of 0..{n - 1}; bad: {bad or ps.ranks}")
    for other in st.process_sets.values():
        if other.ranks == ps.ranks:
            raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    from .controller import Controller
    controller = Controller(st, ps.ranks, f"process_set{ps.ranks}")
    ps.process_set_id = st.next_set_id
    st.next_set_id += 1
    st.process_sets[ps.process_set_id] = ps
    st.controllers[ps.process_set_id] = controller
    return ps


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set after ``init`` (needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` or
    ``init(process_sets="dynamic")``, as in Horovod). Collective over the Horovod world:
    every rank calls it with the same ranks. Returns the registered set; a duplicate
    raises ``ValueError``."""
    st = state.require("add_process_set")
    if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0") in ("", "0"):
        raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets "
                         "after hvd.init().")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None and process_set.mpi_comm is not None:
        raise NotImplementedError(
            "Dynamically adding process sets defined by an MPI communicator is not implemented. "
            "Please build the process set via a list of ranks.")
    del st
    return register(process_set, "add_process_set")


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (collective over the Horovod world); returns whether it
    was removed (never the global set). The set's pending operations fail."""
    st = state.require("remove_process_set")
    pid = process_set.process_set_id
    if pid is None or pid == 0 or pid not in st.process_sets:
        return False
    if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0") in ("", "0"):
        raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow removing process sets "
                         "after hvd.init().")
    st.controllers.pop(pid).close()
    st.process_sets.pop(pid)
    process_set._invalidate()
    return True
