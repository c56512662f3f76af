"""The order of a node window's collectives, and the thread that runs its nonblocking ones.

Every collective through a node window (:mod:`commlib.primitives.node_shm`) moves data
through the same segments and barriers, so the ranks must run them one at a time and in
the same order. Blocking calls have that order by themselves (issue order, one thread).
A nonblocking call (``async_op=True`` where the tier takes it, see
:func:`commlib.primitives.node_shm.use_async`) instead takes a *ticket* when it is issued
and is handed to the window's own thread, which runs the window's operations in ticket
order while the caller goes on (the tier's counterpart of MPI's progress engine: it needs
no ``wait()`` to move, so the overlap and the deadlock freedom are those of a nonblocking
MPI collective; its peers' matching calls are the only thing it waits for). From the first
nonblocking call on, blocking calls through the window take a ticket too and run when
their turn comes, after every operation issued before them, so issue order stays the
order on every rank. Before it, a blocking call pays nothing for this.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..mpi import shutdown


class TierWork:
    """Handle of a nonblocking collective through a node window (the interface of
    :class:`commlib.Work`): ``wait()`` blocks until the window's thread has run it and
    returns its result, or raises its error; ``is_completed()`` never blocks."""

    __slots__ = ("_op", "_done", "_result", "_error")

    def __init__(self, op: str) -> None:
        self._op = op
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def _finish(self, result: Any, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def wait(self, poll_s: float | None = None) -> Any:
        """Block until done; return the result (the in-place tensor) or raise the
        operation's error. ``poll_s`` is accepted for :class:`commlib.Work`'s signature
        (the wait never spins: it sleeps on an event)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def is_completed(self) -> bool:
        """True once the operation has run and its result is in place (or it failed)."""
        return self._done.is_set()

    def cancel(self, grace_s: float = 1.0) -> bool:
        """A collective cannot be cancelled: True if it completes within ``grace_s``."""
        return self._done.wait(grace_s)

    def abandon(self) -> None:
        """Give up on it (a timeout): the window's thread still runs it, holding its
        buffers until then."""

    def result(self) -> Any:
        """The result of a completed operation (``wait()`` first)."""
        if not self._done.is_set():
            raise RuntimeError(f"commlib.{self._op}: result() before the operation "
                               f"completed; call wait() first")
        return self.wait()

    def __repr__(self) -> str:
        state = "completed" if self._done.is_set() else "pending"
        return f"<commlib.Work {self._op} (node shared memory) {state}>"


class Turns:
    """The tickets of one node window's collectives and the thread that runs its
    nonblocking ones (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        #: a nonblocking operation was issued: blocking ones take tickets from then on
        self.active = False
        self._cond = threading.Condition(threading.Lock())
        self._next = 0   # the next ticket handed out
        self._turn = 0   # the ticket whose operation may run now
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # -- blocking operations -----------------------------------------------------------
    def enter(self) -> int | None:
        """Before a blocking operation: wait for its turn; its ticket (None: no ticket
        needed, before any nonblocking operation or on the window's own thread)."""
        if not self.active or threading.current_thread() is self._thread:
            return None
        with self._cond:
            ticket = self._next
            self._next += 1
        self._wait_turn(ticket)
        return ticket

    def leave(self, ticket: int | None) -> None:
        """After a blocking operation (also when it raised): the next ticket's turn."""
        if ticket is not None:
            self._advance()

    def _wait_turn(self, ticket: int) -> None:
        with self._cond:
            while self._turn != ticket:
                self._cond.wait()

    def _advance(self) -> None:
        with self._cond:
            self._turn += 1
            self._cond.notify_all()

    # -- nonblocking operations --------------------------------------------------------
    def submit(self, op: str, run: Callable[[], Any]) -> TierWork:
        """Issue ``run()`` (the whole operation, blocking) to the window's thread; its
        handle. Call order on the issuing rank is the order it runs in."""
        work = TierWork(op)
        with self._cond:
            self.active = True
            ticket = self._next
            self._next += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"commlib-shm-{self.name}")
                self._thread.start()
                shutdown.register(self)
        self._queue.put((ticket, run, work))
        return work

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            ticket, run, work = item
            self._wait_turn(ticket)
            result: Any = None
            error: BaseException | None = None
            try:
                result = run()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                error = exc
            finally:
                self._advance()
            work._finish(result, error)

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Run what was issued and stop the thread; False if it is still running an
        operation after ``timeout_s`` (a peer never made its matching call)."""
        thread = self._thread
        if thread is None:
            return True
        self._queue.put(None)
        thread.join(timeout_s)
        if thread.is_alive():
            sys.stderr.write(f"[commlib] node shared memory ({self.name}): nonblocking "
                             f"collectives were still running at exit (a rank never "
                             f"called them)\n")
            return False
        with self._cond:
            self._thread = None
        return True

    def stop_at_exit(self, deadline: float) -> bool:
        """For :mod:`commlib.mpi.shutdown`: stopped before MPI finalizes, bounded."""
        return self.stop(max(0.0, deadline - time.monotonic()))
