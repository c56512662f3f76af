"""``commlib.elastic.run``: call the training function again on the survivors after a
failure, from the state they agreed on."""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

from ..errors import CommError, PeerFailure
from ..primitives import world
from .state import State


def run(train_fn: Callable[[State], Any] | None = None, state: State | None = None, *,
        min_ranks: int = 1, replace: bool = False,
        spawn_info: Callable[[list[int]], dict] | dict | None = None) -> Any:
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

    ``replace=True`` (under ``mpiexec``): after each recovery the survivors spawn as many
    ranks as died (:func:`commlib.primitives.group.grow`, running this same script;
    ``spawn_info``: the ``MPI_Info`` of the spawn, or a function of the dead world ranks
    returning it, e.g. to place them on the dead ranks' hosts) and send them the state by
    broadcast; in a spawned process ``run`` first receives that state, then calls
    ``train_fn`` with the others.
    """
    if train_fn is None:
        return functools.partial(run, min_ranks=min_ranks, replace=replace,
                                 spawn_info=spawn_info)
    if state is None:
        @functools.wraps(train_fn)
        def wrapped(state: State) -> Any:
            return run(train_fn, state, min_ranks=min_ranks, replace=replace,
                       spawn_info=spawn_info)
        return wrapped
    from ..primitives import ft
    if state.group is None:
        state.__dict__["group"] = world()
        state.__dict__["target_size"] = state.group.size
        if ft.joined:  # spawned to replace a dead rank: take the state first
            _sync(state, None, time.monotonic())
    while True:
        try:
            result = train_fn(state)
            state._settle()
            state.group.barrier()
            return result
        except PeerFailure as exc:
            recover(state, exc, min_ranks, replace, spawn_info)


def recover(state: State, failure: PeerFailure, min_ranks: int = 1, replace: bool = False,
            spawn_info: Any = None) -> None:
    """Collective over the survivors: shrink ``state.group`` and restore the agreed commit
    (what :func:`run` does after a failure; a failure meanwhile starts it again); with
    ``replace``, grow back to the state's ``target_size`` and send the newcomers the state."""
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
    missing = state.target_size - state.group.size
    if replace and missing > 0:
        dead = sorted(r for r in failure.failed if r >= 0)
        info = spawn_info(dead) if callable(spawn_info) else spawn_info
        group = state.group.grow(missing, info=info)
        _sync(state, group, seen)


def _sync(state: State, group: Any, since: float) -> None:
    """Collective over the grown world: everyone takes the state of its rank 0 (the
    newcomers have none yet)."""
    if group is None:
        group = world()
    state.__dict__["group"] = group
    state._receive(group, 0)
    state.recoveries.append({"size": group.size, "members": list(group.ranks),
                             "values": {}, "step": state.step, "grown": True,
                             "seconds": time.monotonic() - since})
