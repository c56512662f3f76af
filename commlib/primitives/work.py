"""Handles of asynchronous operations."""
from __future__ import annotations

from time import monotonic, perf_counter, sleep
from typing import Any, Generator

from mpi4py import MPI

from .. import accounting
from ..communicator import Communicator

# A stage generator yields MPI requests one after the other (a chain such as the three
# steps of a hierarchical allreduce) and returns the operation's result. Each ``yield``
# evaluates to the ``MPI.Status`` of the request it yielded, once that request completed.
Stages = Generator[Any, None, Any]


class Work:
    """Returned by every collective called with ``async_op=True``.

    ``wait()`` blocks until the operation is complete (under the watchdog deadline, like a
    blocking call) and returns its result: the input tensor for in-place collectives, the
    new tensor (or list) for the others. ``is_completed()`` never blocks; it also drives
    multi-stage operations forward. Results in the caller's buffer are only guaranteed after
    ``wait()`` or a ``True`` from ``is_completed()``.
    """

    __slots__ = ("_comm", "_op", "_what", "_stages", "_req", "_done", "_result", "_status",
                 "_t0", "_seq")

    def __init__(self, comm: Communicator, op: str, what: Any, stages: Stages) -> None:
        self._comm, self._op, self._what, self._stages = comm, op, what, stages
        self._t0, self._seq = perf_counter(), comm.seq
        self._done = False
        self._result: Any = None
        self._status = MPI.Status()
        try:
            self._req = next(stages)
        except StopIteration as stop:
            self._complete(stop.value)

    def _advance(self) -> None:
        try:
            self._req = self._stages.send(self._status)
        except StopIteration as stop:
            self._complete(stop.value)

    def _complete(self, result: Any) -> None:
        self._req = None
        self._done = True
        self._result = result
        accounting.timed(self._op, self._t0, perf_counter(), self._comm, self._what, self._seq)

    def is_completed(self) -> bool:
        """True once the operation has finished and its result is in place."""
        while not self._done and self._req.Test(self._status):
            self._advance()
        return self._done

    def wait(self, poll_s: float = 0.0) -> Any:
        """Block until done; return the result (see the class docstring).

        ``poll_s > 0``: test the operation and sleep ``poll_s`` seconds between tests
        instead of blocking in MPI (whose wait spins), leaving the core to other processes
        when ranks outnumber cores; under the watchdog deadline all the same."""
        comm = self._comm
        if poll_s > 0 and not self._done:
            comm.arm(self._op, self._what)
            try:
                while not self.is_completed():
                    sleep(poll_s)
            finally:
                comm.disarm()
        while not self._done:
            comm.arm(self._op, self._what)
            try:
                self._req.Wait(self._status)
            finally:
                comm.disarm()
            self._advance()
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

    def result(self) -> Any:
        """The result of a completed operation (``wait()`` first)."""
        if not self._done:
            raise RuntimeError(f"commlib.{self._op}: result() before the operation completed; "
                               f"call wait() first")
        return self._result

    def __repr__(self) -> str:
        state = "completed" if self._done else "pending"
        return f"<commlib.Work {self._op} {state}>"

