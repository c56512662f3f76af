"""Handles of asynchronous operations."""
from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator
from time import monotonic, perf_counter, sleep
from typing import Any

from mpi4py import MPI

from ..base import accounting
from ..core.communicator import Communicator

# A stage generator yields MPI requests one after the other (a chain such as the three
# steps of a hierarchical allreduce) and returns the operation's result. Each ``yield``
# evaluates to the ``MPI.Status`` of the request it yielded, once that request completed.
#
# Operations whose later stages run on other communicators (the node and leader
# communicators of a hierarchical allreduce) must start those stages in issue order on
# every rank, whatever order the caller waits in: MPI matches collectives on a
# communicator by the order they start, and a later stage starts only once its operation
# is driven (``wait``/``is_completed``), which differs between ranks. Such a generator
# first yields ``Reserve(c1, c2, ...)`` at issue time (a ticket on each communicator, in
# issue order), then brackets what it starts on ``c`` by ``yield Turn(c)`` and
# ``yield Release(c)``: the engine resumes it at ``Turn(c)`` only once every operation
# issued before it released ``c``, driving those earlier operations forward itself when
# the caller waits on a later one (they were issued earlier on every rank, so the order
# is the same everywhere). Tickets not released when an operation ends are released then.
Stages = Generator[Any, None, Any]


class Reserve:
    """Stage-generator token: take a ticket on each communicator (at issue time)."""
    __slots__ = ("comms",)

    def __init__(self, *comms: Communicator) -> None:
        self.comms = comms


class Turn:
    """Stage-generator token: resume once it is this operation's turn on ``comm``."""
    __slots__ = ("comm",)

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm


class Release:
    """Stage-generator token: this operation starts nothing more on ``comm``."""
    __slots__ = ("comm",)

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm


def _release(comm: Communicator, ticket: int) -> None:
    gate = comm.gate
    gate.released.add(ticket)
    gate.holders.pop(ticket, None)
    while gate.turn in gate.released:
        gate.released.discard(gate.turn)
        gate.turn += 1


@contextlib.contextmanager
def turn(*comms: Communicator) -> Iterator[None]:
    """Blocking code that runs collectives on ``comms`` (communicators that multi-stage
    operations use for their later stages) takes its turn after every operation issued
    before it, driving them forward until they have released those communicators."""
    tickets = [(c, c.gate.take(None)) for c in comms]
    try:
        for c, t in tickets:
            _wait_turn(c, t)
        yield
    finally:
        for c, t in tickets:
            _release(c, t)


def _wait_turn(comm: Communicator, ticket: int) -> None:
    gate = comm.gate
    while gate.turn != ticket:
        gate.holders[gate.turn]._step()


#: a Work's tickets before it reserves its turns and after it released them (never changed)
_NO_TICKETS: dict[Communicator, int] = {}


class Work:
    """Returned by every collective called with ``async_op=True``.

    ``wait()`` blocks until the operation is complete (under the watchdog deadline, like a
    blocking call) and returns its result: the input tensor for in-place collectives, the
    new tensor (or list) for the others. ``is_completed()`` never blocks; it also drives
    multi-stage operations forward. Results in the caller's buffer are only guaranteed after
    ``wait()`` or a ``True`` from ``is_completed()``.
    """

    __slots__ = ("_comm", "_op", "_what", "_stages", "_req", "_done", "_result", "_status",
                 "_t0", "_seq", "_tickets")

    def __init__(self, comm: Communicator, op: str, what: Any, stages: Stages) -> None:
        self._comm, self._op, self._what, self._stages = comm, op, what, stages
        self._t0, self._seq = perf_counter(), comm.seq
        self._done = False
        self._result: Any = None
        self._status = MPI.Status()
        self._tickets = _NO_TICKETS
        self._req: Any = None
        self._resume(None)

    def _resume(self, value: Any) -> None:
        """Run the stages until they wait on a request, on a turn not yet come, or end."""
        stages = self._stages
        try:
            while True:
                try:
                    item = stages.send(value)
                except StopIteration as stop:
                    self._complete(stop.value)
                    return
                value = None
                cls = item.__class__
                if cls is Turn:
                    if item.comm.gate.turn != self._tickets[item.comm]:
                        self._req = item
                        return
                elif cls is Release:
                    _release(item.comm, self._tickets.pop(item.comm))
                elif cls is Reserve:
                    self._tickets = {c: c.gate.take(self) for c in item.comms}
                else:
                    self._req = item
                    return
        except BaseException:
            self._release_all()
            raise

    def _release_all(self) -> None:
        if self._tickets:
            for c, t in self._tickets.items():
                _release(c, t)
            self._tickets = _NO_TICKETS

    def _step(self) -> None:
        """Block until the operation has moved one stage on (a turn came, a request
        completed), under the watchdog deadline."""
        req = self._req
        if req.__class__ is Turn:
            _wait_turn(req.comm, self._tickets[req.comm])
            self._resume(None)
            return
        comm = self._comm
        comm.arm(self._op, self._what)
        try:
            req.Wait(self._status)
        finally:
            comm.disarm()
        self._resume(self._status)

    def _complete(self, result: Any) -> None:
        self._release_all()
        self._req = None
        self._done = True
        self._result = result
        accounting.timed(self._op, self._t0, perf_counter(), self._comm, self._what, self._seq)

    def is_completed(self) -> bool:
        """True once the operation has finished and its result is in place."""
        while not self._done:
            req = self._req
            if req.__class__ is Turn:
                if not self._poll_turn(req.comm):
                    return False
                self._resume(None)
            elif req.Test(self._status):
                self._resume(self._status)
            else:
                return False
        return True

    def _poll_turn(self, comm: Communicator) -> bool:
        """Drive earlier operations without blocking; True once it is this one's turn."""
        gate, ticket = comm.gate, self._tickets[comm]
        while gate.turn != ticket:
            before = gate.turn
            gate.holders[before].is_completed()
            if gate.turn == before:
                return False
        return True

    def wait(self, poll_s: float | None = None) -> Any:
        """Block until done; return the result (see the class docstring).

        ``poll_s > 0``: test the operation and sleep ``poll_s`` seconds between tests
        instead of blocking in MPI (whose wait spins), leaving the core to other processes
        when ranks outnumber cores; under the watchdog deadline all the same. ``None``
        (the default): the communicator's choice (option ``wait_poll_us``); 0: block."""
        comm = self._comm
        if poll_s is None:
            poll_s = getattr(comm, "poll_s", 0.0)
        if poll_s > 0 and not self._done:
            comm.arm(self._op, self._what)
            try:
                while not self.is_completed():
                    sleep(poll_s)
            finally:
                comm.disarm()
        while not self._done:
            self._step()
        return self._result

    def cancel(self, grace_s: float = 1.0) -> bool:
        """Cancel a pending single-request operation (``MPI_Cancel``: a receive no send
        matched, a send no receive matched) and wait up to ``grace_s`` for the request to
        be released. Returns True when MPI no longer uses the buffers (completed or
        cancelled), False when the request is still active. For shutdown paths."""
        if self._done or self._req is None:
            return True
        self._req.Cancel()
        deadline = monotonic() + grace_s
        while not self._req.Test(self._status):
            if monotonic() > deadline:
                return False
            sleep(1e-3)
        self._req = None
        self._done = True
        return True

    def abandon(self) -> None:
        """Give up on this operation (a timeout): it stays pending in MPI, which may still
        complete it, so its buffers stay alive and its communicator is never freed while it
        is unfinished (:meth:`commlib.core.communicator.Communicator.abandon`)."""
        if not self._done:
            self._comm.abandon(self)

    def result(self) -> Any:
        """The result of a completed operation (``wait()`` first)."""
        if not self._done:
            raise RuntimeError(f"commlib.{self._op}: result() before the operation completed; "
                               f"call wait() first")
        return self._result

    def __repr__(self) -> str:
        state = "completed" if self._done else "pending"
        return f"<commlib.Work {self._op} {state}>"

