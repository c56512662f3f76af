"""Refilling the pool of warm spares (``commlib.elastic.run(spares=K, refill=True)``, under
``mpiexec``): once spares have joined (or died standing by), new spare processes are
spawned so that the pool is back at ``K``, without a replacement's start ever falling on
a recovery.

When: a recovery that leaves the pool short marks the refill due
(:func:`mark_due`); the trainers' next :meth:`State.commit` at which the live state is
its commit (one step after it for ``local_sgd`` and ``diloco``, whose commits are taken
at the next step's average; that step is then redone) raises :class:`RefillDue`, which
:func:`commlib.elastic.run` catches as it catches a failure: the wrapper is closed and the
function called again from that commit once the refill is done. Code after ``commit()``
in that iteration is skipped, as after a failure.

Protocol (collective over the trainers and the idle spares, every one alive; the spawned
processes join in their ``commlib.init()``):

1. the trainers :func:`~commlib.primitives.standby.call` the idle spares with the
   *universe* (trainers in group order, then the pool) and the trainers' count;
2. everyone :func:`~commlib.primitives.group.assemble`\\ s the universe; an idle spare
   found dead is dropped from the pool, a dead trainer raises
   :class:`~commlib.PeerFailure` on every member (the trainers recover; the spares stand
   by again);
3. the assembled group becomes the world and grows by the missing spares
   (:func:`~commlib.primitives.group.grow`: ``MPI_Comm_spawn`` of this script): world
   ranks ``0..T-1`` are the trainers, then the old spares, then the new ones;
   the newcomers are told their role with the grow (its ``note``: a spare, not a
   replacement of ``replace=True``; :func:`told`);
4. the trainers make their group among themselves (no collective with the spares or the
   newcomers).

The newcomers run the script up to ``run`` like any rank (importing everything and
building the model and the optimizer) and stand by, without a collective on the way:
the trainers wait for the spawn alone, which :mod:`commlib.tools.spawned` makes the new
processes' start up to MPI's and commlib's (a fraction of a second; the script's own
imports, torch among them, come after), and a death meanwhile finds no newcomer outside
``run``'s recovery.
"""
from __future__ import annotations

import sys
import time
from typing import Any

from ..base.errors import PeerFailure
from ..primitives import ft, standby, world
from ..primitives.group import Group, assemble, group_from_ranks
from .policies import SYNCED

#: The roles a spawned process is told (:func:`told`).
REPLACEMENT, SPARE = 0, 1
#: Seconds the trainers give their refill calls to reach the idle spares.
CALL_S = 10.0


class RefillDue(Exception):  # noqa: N818 - a signal, as StopIteration
    """Raised by :meth:`commlib.elastic.State.commit` on every trainer at the same step
    when the pool of spares is due for a refill; :func:`commlib.elastic.run` catches it
    (it never reaches the caller of ``run``)."""


def refusal() -> str:
    """Why no process can be spawned here ('' where it can): ``refill`` is refused up
    front where spawning is."""
    return ft.spawn_refusal()


def mark_due(state: Any) -> None:
    """After a recovery, on every member of the group (the same on each: the pool is
    agreed): mark the refill due where ``refill`` is on and the pool is short."""
    d = state.__dict__
    if d.get("_refill") and len(state.spares) < d.get("spare_target", 0):
        d["_refill_due"] = True


def due(state: Any) -> bool:
    """Whether :meth:`State.commit` should raise :class:`RefillDue` now (its live state
    is at its last commit, or one step after it for commits taken at an average)."""
    d = state.__dict__
    if not d.get("_refill_due") or not state._commits:
        return False
    behind = state.step - state.last_commit
    return behind == 0 or (state.policy == SYNCED and behind == 1)


def refill(state: Any, spawn_info: Any = None) -> None:
    """On every trainer (from :func:`commlib.elastic.run`, after :class:`RefillDue`):
    go back to the last commit, call the idle spares and spawn the missing ones."""
    d = state.__dict__
    d["_refill_due"] = False
    start = time.monotonic()
    state.close_wrapper()
    state.drop_gradients()
    state._restore_own(state.last_commit)
    trainers = tuple(state.group.ranks)
    universe = trainers + tuple(state.spares)
    # (MPI reads the spawn's info at its root alone: trainer 0, a survivor of the last
    # recovery, which knows whom the spares replaced)
    info = None
    if state.group.rank == 0:
        dead = list(d.get("_replaced", ()))
        info = spawn_info(dead) if callable(spawn_info) else spawn_info
    requests = standby.call(state.spares, ("refill", universe, len(trainers)))
    try:
        spawned = _grow(state, universe, len(trainers), info)
    finally:
        standby.settle(requests, CALL_S)
    d["recoveries"].append({"size": state.group.size, "members": list(state.group.ranks),
                            "values": {}, "step": state.step, "refilled": spawned,
                            "spares": list(state.spares),
                            "seconds": time.monotonic() - start})


def take_part(state: Any, message: tuple) -> None:
    """On an idle spare called with ``message`` (``("refill", universe, trainers)``):
    its part of the refill; it stands by again afterwards."""
    _, universe, trainers = message
    _grow(state, tuple(universe), int(trainers), None)


def _grow(state: Any, universe: tuple[int, ...], trainers: int, info: Any) -> int:
    """Collective over the living of ``universe``; the processes spawned."""
    group = assemble(universe)
    members = tuple(group.ranks)
    lost = [r for r in universe[:trainers] if r not in members]
    if lost:  # a trainer died: the trainers recover (the spares stand by again)
        raise PeerFailure(f"commlib.elastic refill (world rank {world().rank}): trainer(s) "
                          f"{lost} died before the pool was refilled", failed=lost)
    missing = state.spare_target - (len(members) - trainers)
    if missing <= 0:
        return 0
    ft.become_world(group.comm)
    # (this script again, behind commlib.tools.spawned: the spawn returns once the new
    # processes have joined, before the script's imports)
    grown = group.grow(missing, command=sys.executable,
                       args=["-m", "commlib.tools.spawned", *sys.argv], info=info,
                       note=(SPARE, trainers, state.target_size))
    _settle(state, grown.size, trainers)
    return missing


def told() -> tuple[int, int, int] | None:
    """On a process spawned by a grow (``commlib.primitives.ft.joined``): what its parents
    told it, (:data:`SPARE` or :data:`REPLACEMENT`, the trainers' count, their target
    size); None where they said nothing (a grow outside ``commlib.elastic``)."""
    note = ft.joined_note
    if not (isinstance(note, tuple) and len(note) == 3 and note[0] in (REPLACEMENT, SPARE)):
        return None
    return note


def join_as_spare(state: Any, trainers: int, target: int, spares: int) -> None:
    """On a newcomer told :data:`SPARE` (no collective: the trainers do not wait for it to
    build its model): the state of an idle spare of the grown world."""
    d = state.__dict__
    d["target_size"] = target
    d["spare_target"] = spares
    d["_empty"] = True
    _settle(state, world().size, trainers)


def _settle(state: Any, size: int, trainers: int) -> None:
    """The trainers' group (world ranks ``0..T-1`` of the grown world of ``size`` ranks,
    built by the trainers alone) and the pool (the rest), on every rank."""
    d = state.__dict__
    ranks = list(range(trainers))
    d["group"] = group_from_ranks(ranks) if world().rank < trainers else Group(None, ranks)
    d["spares"] = list(range(trainers, size))
    d["_refill_due"] = False
