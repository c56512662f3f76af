"""Collectives that complete in the background: the overlap of torch's DDP.

torch's DDP starts a bucket's allreduce from the backward pass and asks for its future at
once; it waits on the futures only at the end of backward. A collective called with
``asyncOp`` (the default of the options torch's C++ callers pass, and what
``async_op=True`` sets) is therefore started as a non-blocking MPI request in the calling
thread, in call order on every rank, and handed to one progress thread per process that
waits for each request inside MPI (without the GIL) and then completes the handle and its
future; backward computes meanwhile. Calls with ``async_op=False`` stay blocking (no
thread hop on the latency-bound path). Needs ``MPI_THREAD_MULTIPLE``; under a lower
thread level everything runs blocking. The thread is stopped at exit, before MPI
finalizes.

The thread completes each operation within its group's timeout (:mod:`.deadlines`): an
operation still pending at its deadline fails its handle and future with the timeout
error, and the thread goes on with the next one.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work

from ..core import runtime
from ..mpi import shutdown
from ..primitives import Work as CommlibPending
from .convert import where
from .deadlines import GroupDeadlines, seconds


class BackgroundWork(Work):
    """Handle of a collective the progress thread completes: ``wait()`` blocks until it
    has (without holding the GIL), ``get_future()`` returns the future at once (torch's DDP
    chains on it), its value the list of tensors. ``deadlines``/``op``/``deadline``: the
    group's timeout state, the operation's name and its deadline; ``event``: its profiler
    event, ended once it completes (:mod:`.profiling`)."""

    def __init__(self, result: list, after: Callable[[Any], None] | None = None,
                 deadlines: GroupDeadlines | None = None, op: str = "",
                 deadline: float = float("inf"), event: Any = None) -> None:
        super().__init__()
        self._result = result
        self._after = after
        self._deadlines = deadlines
        self._op = op
        self._deadline = deadline
        self._event = event
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._source = -1
        self._collective = True
        devices = sorted({str(t.device) for t in result if t.device.type != "cpu"})
        self._future = torch.futures.Future(devices=devices) if devices else \
            torch.futures.Future()
        if event is not None:
            event.end_when(self._done, deadline - time.monotonic())

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        if error is None:
            self._future.set_result(self._result)
        else:
            self._future.set_exception(error)
        self._done.set()

    def wait(self, timeout: Any = None) -> bool:
        """Block until the operation is complete (the progress thread enforces the group's
        timeout); ``timeout`` (a ``timedelta``) waits at most that long here and then raises
        ``DistBackendError``, leaving the operation to go on."""
        limit = seconds(timeout)
        if not self._done.wait(limit):
            rank = self._deadlines.rank if self._deadlines is not None else -1
            raise dist.DistBackendError(f"{where(self._op or 'Work.wait', rank)}: Timed out "
                                        f"after {limit:g} s in Work.wait(timeout); the "
                                        f"operation is still pending")
        if self._event is not None:
            self._event.ended()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._future.done()  # done before the event is set: the two never disagree

    def is_success(self) -> bool:
        return self._future.done() and self._error is None

    def exception(self) -> Any:
        return self._error

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> list:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        self.wait()
        return self._source

    def _source_rank(self) -> int:
        return self.source_rank()

    def set_source(self, source: int) -> None:
        self._source = source


class _Progress:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, pending: CommlibPending, work: BackgroundWork) -> BackgroundWork:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name="commlib-torch-progress")
                    self._thread.start()
                    shutdown.register(self)
        self._queue.put((pending, work))
        return work

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            pending, work = item
            error: BaseException | None = None
            try:
                if work._deadlines is None:
                    value = pending.wait()
                else:
                    value = work._deadlines.wait(pending, work._op, work._deadline,
                                                 collective=work._collective)
                if work._after is not None:
                    work._after(value)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                error = exc
            try:
                work._finish(error)
            except BaseException as exc:  # noqa: BLE001 - never let the thread die
                work._error = work._error or exc
                work._done.set()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Finish the queued operations and stop the thread; ``False`` if it is still
        inside MPI after ``timeout_s`` (a peer never made its collective)."""
        thread = self._thread
        if thread is None:
            return True
        self._queue.put(None)
        thread.join(timeout_s)
        if thread.is_alive():
            sys.stderr.write("[commlib] torch backend: collectives started with async_op "
                             "were still pending at exit (a rank never called them)\n")
            return False
        self._thread = None
        return True

    def stop_at_exit(self, deadline: float) -> bool:
        """For :mod:`commlib.mpi.shutdown`: stopped before MPI finalizes, bounded."""
        return self.stop(max(0.0, deadline - time.monotonic()))


_progress = _Progress()


def background() -> bool:
    """Whether collectives may complete on the progress thread (MPI_THREAD_MULTIPLE)."""
    return runtime.thread_multiple()


def submit(pending: CommlibPending, result: list,
           after: Callable[[Any], None] | None = None, deadlines: GroupDeadlines | None = None,
           op: str = "", deadline: float = float("inf"), event: Any = None,
           collective: bool = True, source: int = -1) -> BackgroundWork:
    """Hand a started commlib operation to the progress thread; its handle. ``after(value)``
    runs on that thread once the operation completed (copying results out); the operation
    must complete by ``deadline`` (see :class:`BackgroundWork`); ``collective=False``: a
    point-to-point operation (a timeout cancels it and leaves the group usable), whose
    handle's ``_source_rank()`` is ``source``."""
    work = BackgroundWork(result, after, deadlines, op, deadline, event)
    work._collective, work._source = collective, source
    return _progress.submit(pending, work)
