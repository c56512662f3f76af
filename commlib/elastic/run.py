"""``commlib.elastic.run``: call the training function again on the survivors after a
failure, from the state they agreed on."""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from ..base.errors import CommError, PeerFailure
from ..primitives import ft, world
from . import refill as refill_module
from .spares import _reached, release, split, stand_by, top_up
from .state import State
from .zero import is_zero


def run(train_fn: Callable[[State], Any] | None = None, state: State | None = None, *,
        min_ranks: int = 1, replace: bool = False,
        spawn_info: Callable[[list[int]], dict] | dict | None = None,
        spares: int = 0, refill: bool = False) -> Any:
    """Run ``train_fn(state)`` until it returns on every survivor (fault-tolerant mode:
    ``commlib.init(fault_tolerant=True)`` or ``COMMLIB_FAULT_TOLERANT=1``).

    When a peer dies, ``train_fn`` sees :class:`~commlib.PeerFailure` from whatever
    collective it was in (on every survivor); ``run`` then closes the state's wrapper,
    drops the gradients, shrinks the state's group to the survivors (who agree on the
    commit to go on from), restores that commit on every survivor (by broadcast for those
    that lack it; see :class:`State`), and calls ``train_fn(state)`` again, now over the
    survivors' group (``state.group``; ``state.step`` is the agreed step). A failure during
    the recovery starts it again without the newly dead rank. Once ``train_fn`` returned,
    a barrier on the group makes sure every survivor finished (a survivor still inside the
    last step when a rank died recovers with the others). Fewer than ``min_ranks``
    survivors raise :class:`~commlib.CommError` on every survivor. Returns what
    ``train_fn`` returned. Also usable as a decorator, ``@run`` (then called with the
    state), or ``@run(min_ranks=2)``.

    ``spares=K`` (launch ``N + K`` ranks, e.g. ``mpiexec -n N+K``): the last ``K`` world
    ranks are warm spares (:mod:`commlib.elastic.spares`): they run the script up to
    ``run`` like the others, then wait idle in ``run`` (no share of the training's
    collectives: ``state.group`` is the first ``N`` ranks). After a trainer's death and
    the survivors' recovery, one spare per dead trainer joins the survivors' group (after
    them, in world-rank order), receives the committed state from a survivor and trains:
    the group is back at ``N`` ranks without a process start. A spare's death while idle
    is a failure like any other for the trainers (they recover among themselves; the
    spare leaves the pool). Once the spares are used up, a death is handled as without
    them (``replace`` or going on shrunk). On every rank ``state.spares`` lists the idle
    spares as this rank knows them. When training ends, every trainer returns
    ``train_fn``'s result and tells the idle spares to go; on an idle spare ``run``
    returns ``None`` (its ``state.group`` is the trainers' group, of which it is not a
    member: ``state.group.rank == -1``). ``spares`` outside ``0..world size - 1`` raise
    ``ValueError`` on every rank.

    ``refill=True`` (with ``spares``, under ``mpiexec``): the pool is kept at ``K``. Once
    a recovery has used spares up (or found one dead), the trainers' next commit starts a
    refill (:mod:`commlib.elastic.refill`): the missing spares are spawned (this same
    script behind ``python -m commlib.tools.spawned``, placed by ``spawn_info`` of the
    world ranks that died last), build their model and stand by; training goes on from
    that commit (code after ``commit()`` in that iteration is skipped, as after a
    failure), over a world numbered anew (trainers first, then the spares). The trainers
    wait for the new processes' MPI start only (their imports and model come after); a
    trainer's death during the refill is a failure like any other, an idle spare's leaves
    it out. Refused (on every rank, ``CommError``) where nothing can spawn (Intel MPI, a
    world formed from a store); ``refill`` without ``spares`` raises ``ValueError``.

    ``replace=True`` (under ``mpiexec``): after each recovery the survivors spawn as many
    ranks as died (:func:`commlib.primitives.group.grow`, running this same script;
    ``spawn_info``: the ``MPI_Info`` of the spawn, or a function of the dead world ranks
    returning it, e.g. to place them on the dead ranks' hosts) and send them the state by
    broadcast; in a spawned process ``run`` first receives that state, then calls
    ``train_fn`` with the others. With spares: only once no spare is left. A death while a
    replacement joins (its own, or a survivor's) is a failure like any other: a
    replacement without the state yet recovers with the survivors as a member without
    state and receives the agreed commit, and the living spawn again. A spawned process
    is watched by process id on its machine and by a TCP connection from other machines
    (``failure_detection.Watcher.watch_grown``, :mod:`commlib.fault.peer_sockets`).
    """
    if train_fn is None:
        return functools.partial(run, min_ranks=min_ranks, replace=replace,
                                 spawn_info=spawn_info, spares=spares, refill=refill)
    if state is None:
        @functools.wraps(train_fn)
        def wrapped(state: State) -> Any:
            return run(train_fn, state, min_ranks=min_ranks, replace=replace,
                       spawn_info=spawn_info, spares=spares, refill=refill)
        return wrapped
    if (spares or replace) and is_zero(state.optimizer):
        raise CommError("commlib.elastic.run: spares and replace=True are not supported "
                        "with a ZeroRedundancyOptimizer (a newcomer would need a shard of "
                        "its own cut out of the others'; the survivors go on shrunk)")
    if refill:
        if not spares:
            raise ValueError(f"commlib.elastic.run (rank {world().rank}): refill=True "
                             f"needs spares > 0 (the pool to keep full)")
        why = refill_module.refusal()
        if why:
            raise CommError(f"commlib.elastic.run (rank {world().rank}): refill=True "
                            f"spawns processes, which this MPI cannot: {why}")
    state.__dict__["_refill"] = bool(refill)
    standing_by = joining = refilling = False
    if state.group is None:
        if spares and not ft.joined:
            standing_by = not split(state, int(spares))
        else:
            told = refill_module.told() if ft.joined else None
            if told is not None and told[0] == refill_module.SPARE:
                # spawned to refill the pool: stand by
                refill_module.join_as_spare(state, told[1], told[2], int(spares))
                standing_by = True
            else:
                state.__dict__["group"] = world()
                state.__dict__["target_size"] = state.group.size
                if ft.joined:  # spawned to replace a dead rank: take the state first
                    state.__dict__["_empty"] = joining = True
    failure: PeerFailure | None = None
    while True:
        try:
            if joining:  # (a death meanwhile: this rank recovers with the others, as
                joining = False  # a member without state, and receives the commit)
                _sync(state, None, time.monotonic())
            if failure is not None:
                exc, failure = failure, None
                recover(state, exc, min_ranks, replace, spawn_info)
            if refilling:
                refilling = False
                refill_module.refill(state, spawn_info)
            if standing_by:
                if not stand_by(state):
                    return None  # released: training is over
                standing_by = False
            result = train_fn(state)
            state._settle()
            state.group.barrier()
            release(state)
            return result
        except refill_module.RefillDue:
            refilling = True
        except PeerFailure as exc:
            failure = exc
            # a spare merged into the group (its joining interrupted by a death: it takes
            # part in the recovery, then trains) no longer stands by
            standing_by = standing_by and not state.group.is_member


def recover(state: State, failure: PeerFailure, min_ranks: int = 1, replace: bool = False,
            spawn_info: Any = None) -> None:
    """Collective over the survivors: shrink ``state.group`` and restore the agreed commit
    (what :func:`run` does after a failure; a failure meanwhile starts it again); then
    merge idle spares (``state.spares``) until the group is back at the state's
    ``target_size``; with ``replace``, once no spare is left, grow back to it and send the
    newcomers the state."""
    seen = time.monotonic()
    old_size = state.group.size
    while True:
        state.close_wrapper()
        state.drop_gradients()
        try:
            group = state.group.shrink(value=state._value())
            if group.size < min_ranks:
                raise CommError(f"commlib.elastic.run (rank {group.rank}): {group.size} "
                                f"rank(s) survive, fewer than min_ranks={min_ranks}")
            state._restore(group, old_size)  # the state's group is the new one from here
            break
        except PeerFailure:
            continue  # another death: agree again without it
    state.recoveries[-1].update(failed=list(failure.failed), seconds=time.monotonic() - seen)
    if state.spares:
        top_up(state, seen)
        # (where a refill places the spares that replace them: spawn_info's argument)
        state.__dict__["_replaced"] = sorted(r for r in failure.failed if r >= 0)
    refill_module.mark_due(state)
    missing = state.target_size - state.group.size
    if replace and missing > 0:
        dead = sorted(r for r in failure.failed if r >= 0)
        info = spawn_info(dead) if callable(spawn_info) else spawn_info
        ft.become_world(state.group.comm)  # (spares merged or dead: nothing else lives)
        group = state.group.grow(missing, info=info, note=(refill_module.REPLACEMENT,
                                                           state.target_size,
                                                           state.target_size))
        _sync(state, group, seen)


def _sync(state: State, group: Any, since: float) -> None:
    """Collective over the grown world: the newcomers (``group`` None: this rank was
    spawned) take the state of its rank 0 as their own; the survivors hold theirs (their
    own optimizer and per-rank algorithm state stay)."""
    fresh = group is None
    if fresh:
        group = world()
    state.__dict__["group"] = group
    _reached("assembled" if fresh else "sending")
    state._receive(group, 0, keep=not fresh, adopted=fresh)
    if fresh:
        _reached("received")
    state.recoveries.append({"size": group.size, "members": list(group.ranks),
                             "values": {}, "step": state.step, "grown": True,
                             "seconds": time.monotonic() - since})
