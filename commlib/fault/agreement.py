"""The survivors' agreement after a failure: who is left, and on which step to go on.

Run by :func:`commlib.primitives.ft.shrink` on every survivor of a fault-tolerant group;
only point-to-point messages on a control communicator (a ``Dup`` of ``MPI_COMM_WORLD``
made while every rank was alive), nonblocking and polled, so that a peer dying at any
moment never blocks it (under ULFM the probes acknowledge the failures first, see
:mod:`commlib.fault.ft_backend`, which also says why ``MPI_Comm_agree`` is not used). Built on
the failure detector of :mod:`commlib.fault.fault_tolerance`, which is *perfect* (a rank is
reported dead only once its process has ended; no false suspicions) and *eventually
complete* (every survivor eventually sees every death).

Each survivor ``p`` keeps ``D_p``, the ranks of the group it knows dead (its detector's, the
ranks that left the program, and every ``D`` a peer sent it: all of them really dead), and a
value ``v_p`` (the caller's: the step it has committed). Whenever ``D_p`` changes, ``p``
sends ``(D_p, g, v_p)`` to every member not in ``D_p`` (``g``: how many decisions ``p`` made
on that same ``D`` before, so that a shrink without a new death is not confused with the
last one). ``p`` **decides** once it has heard from every member outside ``D_p`` a message
carrying exactly its own ``(D_p, g)``: the survivors are the members outside ``D_p``, and the
values are those of these messages (so ``min``/``max`` are the same on every decider).

*Agreement.* Two survivors that decide, decide the same ``D``: a member outside both sets
sent both, and one process's ``D`` only grows, so the two are ordered; ``p`` sends nothing
after deciding, and ``q`` deciding needs ``p``'s message with ``q``'s set (and the converse),
so each set contains the other. A survivor that has not decided yet either decides the same
``D`` (the messages it needs were all sent) or learns of a later death and goes on with a
larger ``D``, which the deciders then reach too, since the communicator they build includes
the newly dead rank and fails (see :func:`commlib.primitives.ft.shrink`): a second failure
during recovery means another round, never a hang and never two groups.

*Termination.* Every death is eventually seen by every survivor, and every survivor that
waits in a collective of the group sees :class:`~commlib.base.errors.PeerFailure` and calls the
agreement; a rank that left the program (exit message of :mod:`commlib.core.exits`) counts as
dead here. Each round costs one small message to each member; with no further failure, the
decision takes one message delay after the last survivor arrives.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI

from ..base.errors import CommError
from .ft_backend import iprobe_any, isend

#: Tag of the agreement's messages on the control communicator.
AGREE_TAG = 21
#: Seconds between two looks at the mailbox while waiting.
POLL_S = 0.0005


@dataclass(frozen=True)
class Decision:
    """What the survivors agreed: ``members`` (world ranks, in order), ``dead`` (the
    group's members known dead), ``values`` (each member's value), and the same on every
    member: ``min``, ``max``, ``holder`` (the first member whose value is ``max``),
    ``generation`` (decisions made before on this same ``dead`` set)."""
    members: tuple[int, ...]
    dead: frozenset
    values: dict = field(compare=False)
    generation: int = 0

    @property
    def min(self) -> int:
        return min(self.values.values())

    @property
    def max(self) -> int:
        return max(self.values.values())

    @property
    def holder(self) -> int:
        top = self.max
        return next(r for r in self.members if self.values[r] == top)


class Agreement:
    """The agreement protocol on the control communicator ``ctl`` (ranks of ``ctl`` are
    world ranks). One per process (:func:`commlib.primitives.ft.agreement`)."""

    def __init__(self, ctl: Any) -> None:
        self.ctl = ctl
        self.me = ctl.Get_rank()
        # (universe, sender) -> {(dead, generation): value}: every message of the sender
        self.heard: dict[tuple[tuple[int, ...], int], dict[tuple[frozenset, int], Any]] = {}
        self.generations: dict[tuple[tuple[int, ...], frozenset], int] = {}
        self.sent: list[Any] = []  # requests (and buffers) of messages: kept, see ft
        self.rounds = 0

    def _drain(self) -> None:
        status = MPI.Status()
        while iprobe_any(self.ctl, AGREE_TAG, status):  # ULFM: failures acknowledged
            source = status.Get_source()
            universe, dead, generation, value = self.ctl.recv(source=source, tag=AGREE_TAG)
            self.heard.setdefault((universe, source), {})[(dead, generation)] = value

    def decide(self, universe: Iterable[int], value: Any,
               dead: Callable[[], Iterable[int]], timeout: float) -> Decision:
        """Collective over the survivors of ``universe`` (world ranks; this rank among
        them): agree on the survivors and their values (see the module docstring).
        ``dead()``: ranks known dead now. Raises :class:`CommError` after ``timeout``
        seconds without a decision, and when this rank is itself counted dead."""
        universe = tuple(universe)
        members = frozenset(universe)
        me = self.me
        known = frozenset(dead()) & members
        sent: tuple[frozenset, int] | None = None
        start = time.monotonic()
        while True:
            self._drain()
            for q in universe:
                for seen, _ in self.heard.get((universe, q), ()):
                    known |= seen
            known |= frozenset(dead()) & members
            if me in known:
                raise CommError(f"commlib.shrink (rank {me}): the other survivors count this "
                                f"rank as dead (it left the program?); it cannot rejoin")
            generation = self.generations.get((universe, known), 0)
            if sent != (known, generation):
                message = (universe, known, generation, value)
                for q in universe:
                    if q != me and q not in known:  # (None: the library knows q dead)
                        self.sent.append(isend(self.ctl, message, q, AGREE_TAG))
                sent = (known, generation)
                self.rounds += 1
            live = [q for q in universe if q not in known]
            values = {}
            for q in live:
                if q == me:
                    values[q] = value
                    continue
                messages = self.heard.get((universe, q), {})
                if (known, generation) not in messages:
                    break
                values[q] = messages[(known, generation)]
            else:
                self.generations[(universe, known)] = generation + 1
                return Decision(tuple(live), known, values, generation)
            if time.monotonic() - start > timeout:
                waiting = [q for q in live if q not in values]
                heard = {q: [(sorted(d), g) for d, g in m] for (u, q), m in
                         self.heard.items() if u == universe}
                raise CommError(f"commlib.shrink (rank {me}): no agreement among the "
                                f"survivors {live} after {timeout:g} s (COMMLIB_TIMEOUT); "
                                f"still waiting for rank(s) {waiting}; this rank knows "
                                f"{sorted(known)} dead (generation {generation}) and heard "
                                f"(dead, generation) {heard}")
            time.sleep(POLL_S)
