"""Warm spares for :func:`commlib.elastic.run` (``run(..., spares=K)``, under
``mpiexec -n N+K``): the last ``K`` world ranks run the script up to ``run`` like the
others (so they have imported everything and built the model and the optimizer), then
stand by; after a death, one spare per dead trainer joins the survivors and receives the
committed state, with no process start.

Protocol (all on commlib's fault-tolerant primitives):

* **Split** (collective over the world, at the first ``run``): the trainers' group is the
  world minus the spares (:func:`commlib.new_group`); ``state.spares`` is the pool (world
  ranks, in order), the same on every rank.
* **Standing by**: a spare waits in :func:`commlib.primitives.standby.wait_call` (a probe
  every few milliseconds, sleeping in between; no collective of the training); the
  trainers' collectives fail on its death as on any death of the job (the failure domain
  is the whole job, :mod:`commlib.fault.fault_tolerance`), they recover among themselves and
  the dead spare leaves the pool at the next merge (the agreement counts it dead).
* **Merge** (after the survivors' shrink and restore, :func:`top_up`): the survivors pick
  the first ``missing`` spares of the pool; every survivor sends each of them the
  *universe* (survivors in their order, then the picked spares in pool order) and the
  rest of the pool; survivors and picked spares call
  :func:`commlib.primitives.group.assemble` over that universe (a picked spare that is
  dead is left out by the agreement and the next one is picked), then each joined spare
  receives the state from one survivor, point to point (``State._transfer``: the survivors
  all hold the agreed commit, none receives anything). Every step
  depends only on agreed data, so every member computes the same groups.
* **Release** (training returned on every trainer): every trainer tells the spares left
  and marks their exit as expected on its group (collectives on ``state.group`` after
  ``run`` are not disturbed by it); ``run`` returns ``None`` on a released spare.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..base.errors import CommError, PeerFailure
from ..base.options import options
from ..primitives import ft, standby, world
from ..primitives.group import assemble, new_group
from . import refill, transfer
from .state import State

#: Test hook: the joining spare keeps its own model instead of the one it received. Wrong
#: on purpose, for the negative control of the tests.
_SKIP_STATE = False
#: Seconds the trainers give their release messages to get out.
RELEASE_S = 10.0
#: Test hook: called on a joining spare with the name of each point of its joining it
#: reaches: ``"called"`` (the call received, before the merged group is built),
#: ``"assembled"`` (the merged group built, before the state is sent),
#: ``"receiving"`` (the first tensor of the state received, the others not yet),
#: ``"received"`` (the state applied, before training); on a survivor: ``"sending"`` (the
#: merged group built, before it sends the state). The tests make a rank die there.
_JOIN_HOOK: Callable[[str], None] | None = None


def _reached(point: str) -> None:
    if _JOIN_HOOK is not None:
        _JOIN_HOOK(point)


def split(state: State, spares: int) -> bool:
    """Collective over the world (every rank alive, first ``run``): set ``state.group``
    to the trainers' group (the world minus its last ``spares`` ranks), ``state.spares``
    and ``state.target_size``; whether this rank trains (False on a spare)."""
    w = world()
    me = w.rank
    if not options.fault_tolerant:
        raise CommError(f"commlib.elastic.run (rank {me}): spares={spares} needs "
                        f"fault-tolerant mode (COMMLIB_FAULT_TOLERANT=1 or "
                        f"commlib.init(fault_tolerant=True))")
    if not 0 < spares < w.size:
        raise ValueError(f"commlib.elastic.run (rank {me}): argument 'spares'={spares} must "
                         f"be >= 0 and smaller than the world size {w.size} (at least one "
                         f"rank trains)")
    ranks = list(w.ranks)
    trainers, pool = ranks[:-spares], ranks[-spares:]
    d = state.__dict__
    d["group"] = new_group(trainers, parent=w)
    d["target_size"] = len(trainers)
    d["spares"] = pool
    d["spare_target"] = len(pool)
    trains = w.ranks[me] in trainers
    d["_empty"] = not trains  # (a spare holds no state until it joined)
    return trains


def stand_by(state: State) -> bool:
    """On a spare: wait idle until the trainers call it; then join them (see
    :func:`top_up`) and return True (``state.group`` is the merged group, the state the
    committed one); False when released at the end of training. A call to refill the
    pool (:mod:`commlib.elastic.refill`) is taken part in, and the wait goes on."""
    while True:
        w = world()  # (a refill makes a new world: ranks counted anew)
        me = w.ranks[w.rank]
        pool = frozenset(state.spares)
        others = [r for r in w.ranks if r not in pool]

        def give_up(gone: frozenset) -> str | None:  # nobody is left to call this spare
            if all(r in gone for r in others):
                return f"every trainer ({others}) died or left"
            return None

        message = standby.wait_call(give_up)
        seen = time.monotonic()
        if message[0] == "release":  # (trainer 0 waits for this answer before it leaves)
            standby.settle(standby.call([state.group.ranks[0]], ("released", me)),
                           RELEASE_S)
            return False
        if message[0] == "refill":
            try:
                refill.take_part(state, message)
            except PeerFailure:
                pass  # a trainer died: the trainers recover; this spare stands by again
            continue
        _, universe, pick, rest, policy = message
        state.__dict__["policy"] = policy  # the trainers' (recovering, the same as theirs)
        _reached("called")
        if me not in pick:  # (never sent: a call goes to the ranks it picks)
            raise CommError(f"commlib.elastic.run (rank {me}): called as {pick} into "
                            f"{universe}")
        _merge(state, universe, pick, rest, seen)
        top_up(state, seen)
        refill.mark_due(state)
        return True


def top_up(state: State, since: float) -> None:
    """Collective over ``state.group`` (the survivors, every one holding the agreed commit)
    and the spares it calls: merge spares until the group is back at
    ``state.target_size`` or the pool is empty."""
    while state.spares and state.group.size < state.target_size:
        missing = state.target_size - state.group.size
        pick, rest = list(state.spares[:missing]), list(state.spares[missing:])
        universe = tuple(state.group.ranks) + tuple(pick)
        requests = standby.call(pick, ("join", universe, pick, rest, state.policy))
        _merge(state, universe, pick, rest, since)
        standby.settle(requests, RELEASE_S)


def _merge(state: State, universe: tuple[int, ...], pick: list[int], rest: list[int],
           since: float) -> None:
    """Collective over the living ranks of ``universe`` (the survivors, then the spares
    ``pick``): the merged group; each spare that joined receives the state from one
    survivor."""
    w = world()
    joining = w.ranks[w.rank] in pick
    group = assemble(universe, value=state._value())
    d = state.__dict__
    d["spares"] = list(rest)
    d["group"] = group
    if not any(r in pick for r in group.ranks):
        return  # the spares picked are dead: the next ones are picked
    if group.ranks[0] in pick:
        raise CommError(f"commlib.elastic.run (rank {group.rank}): no trainer of "
                        f"{list(universe[:len(universe) - len(pick)])} survived into the "
                        f"merged group {list(group.ranks)}: nobody holds the state")
    own = ({k: v.detach().clone() for k, v in state.model.state_dict().items()}
           if joining and _SKIP_STATE else None)
    # each joining spare from one survivor (all hold the agreed commit), point to point:
    # the survivors do not receive what they hold
    olds = [i for i, r in enumerate(group.ranks) if r not in pick]
    news = [i for i, r in enumerate(group.ranks) if r in pick]
    _reached("assembled" if joining else "sending")
    if joining:
        transfer._RECV_HOOK = (lambda i: _reached("receiving") if i == 0 else None) \
            if _JOIN_HOOK is not None else None
    try:
        state._transfer(group, {j: olds[k % len(olds)] for k, j in enumerate(news)})
    finally:
        transfer._RECV_HOOK = None
    if joining:
        _reached("received")
    if own is not None:
        with torch.no_grad():
            state.model.load_state_dict(own)
    d["recoveries"].append({"size": group.size, "members": list(group.ranks),
                            "values": {}, "step": state.step,
                            "joined": [r for r in group.ranks if r in pick],
                            "seconds": time.monotonic() - since})


def release(state: State) -> None:
    """On every trainer, training over (after the final barrier): tell the spares left
    that they may go, and expect their exit on the trainers' group."""
    pool = list(state.spares or ())
    if not pool:
        return
    requests = standby.call(pool, ("release",))
    ft.expect_exit(state.group.comm, pool)
    standby.settle(requests, RELEASE_S)
    if state.group.rank != 0:
        return
    # Trainer 0 stays until every living spare has answered: a spare still starting
    # (spawned by a refill shortly before the end) would otherwise find every trainer
    # gone before it reads its release, which MPI may not deliver once they left.
    waiting = set(pool)

    def done(gone: frozenset) -> str | None:
        waiting.difference_update(gone)
        return None if waiting else "every spare answered or died"

    while waiting:
        try:
            message = standby.wait_call(done, timeout=max(RELEASE_S, options.timeout))
        except CommError:
            return  # (answered or dead, every one; or past the time limit)
        if message[0] == "released":
            waiting.discard(message[1])
