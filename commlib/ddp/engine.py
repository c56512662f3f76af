"""The communication thread: runs jobs one at a time, in submission order.

MPI progresses a non-blocking request only while some thread is inside MPI. Bucket
exchanges therefore run on this thread, which waits inside MPI (a blocking wait on the
requests a job returns) while autograd computes on the main thread; mpi4py releases the GIL
inside MPI calls, so both really run at once. A blocking wait beat polling from Python in
``benchmarks/bench_ddp.py`` (42 against 46-50 ms per step at 2 ranks on 2 cores): a polling
loop needs the GIL that autograd's hooks also need, and sleeps between polls stall MPI. Jobs run strictly in submission order, which every rank
keeps identical, so collectives match across ranks. Needs ``MPI_THREAD_MULTIPLE``; without it
the engine runs each job synchronously on the caller's thread (no overlap, same results).
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..mpi import shutdown


def drive(result: Any, poll_s: float | None = None) -> Any:
    """Complete the Work handle(s) a job returned; return the job's result unchanged
    (``Work.wait(poll_s)``: ``None`` the communicator's choice, option ``wait_poll_us``;
    0 block in MPI; > 0 test and sleep between tests)."""
    for work in result if isinstance(result, (list, tuple)) else [result]:
        if hasattr(work, "wait"):
            work.wait() if poll_s is None else work.wait(poll_s)
    return result


class Engine:
    """FIFO executor on one daemon thread (or inline when ``threaded`` is False).
    ``poll_s``: how the thread waits for a job's Work handles: ``None`` as the communicator
    chose (option ``wait_poll_us``), 0 blocking in MPI (whose wait spins), > 0 testing them
    and sleeping ``poll_s`` between tests (ranks that outnumber the cores)."""

    def __init__(self, threaded: bool, name: str = "commlib-comm",
                 poll_s: float | None = None) -> None:
        self.threaded = threaded
        self.poll_s = None if poll_s is None else float(poll_s)
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)``; the Future resolves once its Work handles completed."""
        if self._closed:
            raise RuntimeError("commlib: the communication engine was closed")
        future: Future = Future()
        if not self.threaded:
            _run(future, fn, args, self.poll_s)
            return future
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
            shutdown.register(self)  # stopped before MPI is finalized if never closed
        self._queue.put((future, fn, args))
        return future

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            _run(*item, self.poll_s)
            del item  # idle, keep nothing of the last job (it may hold its owner, a wrapper)

    def close(self, timeout: float | None = None) -> bool:
        """Finish queued jobs and stop the thread (idempotent); wait ``timeout`` seconds at
        most (None: as long as it takes). True once the thread has ended."""
        if not self._closed:
            self._closed = True
            if self._thread is not None:
                self._queue.put(None)
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                return False
            self._thread = None
            shutdown.unregister(self)
        return True

    def stop_at_exit(self, deadline: float) -> bool:
        """:mod:`commlib.mpi.shutdown`: close by ``deadline`` (``time.monotonic()``)."""
        return self.close(max(0.0, deadline - time.monotonic()))

    def __repr__(self) -> str:
        return f"<commlib.Engine {self._name!r}{' closed' if self._closed else ''}>"


def _run(future: Future, fn: Callable[..., Any], args: tuple,
         poll_s: float | None = None) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(drive(fn(*args), poll_s))
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
        future.set_exception(exc)
