"""Handles the backend returns to torch: ``torch.distributed.Work`` objects whose
``wait()`` and ``get_future()`` both complete the operation.

Blocking collectives get handles born complete (:func:`done`); asynchronous ones get a
:class:`commlib.torch_backend.progress.BackgroundWork`, completed by the progress thread.
Point-to-point operations are real non-blocking MPI requests (so paired
``isend``/``irecv`` never deadlock): ``wait()`` completes them within the group's timeout
(:mod:`.deadlines`), and ``get_future()`` does the same before it returns a completed
future, because torch's DDP waits on the future, and with MPI nothing makes progress
unless someone calls into it; ``is_completed()`` tests without blocking.

Pending point-to-point handles are kept in :data:`_in_flight` until they complete, so the
tensors MPI reads or writes stay alive even when the caller drops the handle. At exit
(before MPI is finalized and before Python frees module objects) operations still pending
get a short grace period to complete (typically a matched ``isend``/``irecv`` pair nobody
waited for), then are cancelled; otherwise MPI would finish them during finalization
into memory Python had already freed.
"""
from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._C._distributed_c10d import Work

from ..mpi import shutdown
from ..primitives import Work as CommlibPending
from . import profiling
from .deadlines import GroupDeadlines, seconds


class CommlibWork(Work):
    """``result`` is the list of tensors the operation wrote (or read, for a send); it is
    the value of the future. ``pending``: a commlib :class:`commlib.Work` still to
    complete, within ``deadlines``' timeout counted from now (``op`` names it in errors);
    ``on_done(value)`` runs once with its ``wait()`` value (recv from any source records
    the sender this way); ``event``: the profiler event to close on completion."""

    def __init__(self, result: list, pending: CommlibPending | None = None,
                 on_done: Callable[[Any], None] | None = None, source: int = -1,
                 deadlines: GroupDeadlines | None = None, op: str = "",
                 event: Any = None) -> None:
        super().__init__()
        self._result = result
        self._pending = pending
        self._on_done = on_done
        self._source = source
        self._future: torch.futures.Future | None = None
        self._deadlines = deadlines
        self._op = op
        self._event = event
        self._started = time.monotonic()

    def _complete(self, timeout: Any = None) -> None:
        pending = self._pending
        if pending is None:
            return
        deadlines, timeout_s = self._deadlines, seconds(timeout)
        if deadlines is None:
            value = pending.wait()
        else:
            limit = deadlines.timeout_s if timeout_s is None else timeout_s
            value = deadlines.wait(pending, self._op, self._started + limit, limit,
                                   collective=False)
        self._pending = None
        _in_flight.discard(self)
        profiling.end(self._event)
        if self._on_done is not None:
            self._on_done(value)

    def wait(self, timeout: Any = None) -> bool:
        """Block until the operation is complete; raise ``DistBackendError`` if it is not
        within ``timeout`` (a ``timedelta``; none given: the group's timeout), counted from
        the call that started it."""
        try:
            self._complete(timeout)
        except BaseException:
            _in_flight.discard(self)
            self._pending = None
            raise
        return True

    def is_completed(self) -> bool:
        if self._pending is not None and self._pending.is_completed():
            self._complete()
        return self._pending is None

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self) -> Any:
        return None

    def get_future(self) -> torch.futures.Future:
        """A completed future whose value is the list of tensors (completes the operation
        first if it is still pending)."""
        self._complete()
        if self._future is None:
            devices = sorted({str(t.device) for t in self._result
                              if isinstance(t, torch.Tensor) and t.device.type != "cpu"})
            fut = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
            fut.set_result(self._result)
            self._future = fut
        return self._future

    def result(self) -> list:
        self._complete()
        return self._result

    def source_rank(self) -> int:
        self._complete()
        return self._source

    def _source_rank(self) -> int:
        return self.source_rank()

    def synchronize(self) -> None:
        self._complete()

    def set_source(self, source: int) -> None:
        self._source = source


class _Done(CommlibWork):
    """A :class:`CommlibWork` born complete: only the C++ base and the result are set per
    handle (the rest are the class's defaults), so a blocking collective's handle costs
    about a third of a full one."""

    _pending = None
    _on_done = None
    _source = -1
    _future = None
    _deadlines = None
    _op = ""
    _event = None
    _started = 0.0

    def __init__(self, result: list) -> None:  # noqa: D107 - see the class
        Work.__init__(self)
        self._result = result


def done(tensors: list) -> CommlibWork:
    """The handle of a completed operation."""
    return _Done(list(tensors))


_in_flight: set[CommlibWork] = set()
_SWEEP_AT = 64


def track(work: CommlibWork) -> CommlibWork:
    """Keep a pending handle (and so its tensors) alive until it completes; completed
    handles nobody waited for are dropped now and then."""
    global _SWEEP_AT
    _in_flight.add(work)
    if len(_in_flight) >= _SWEEP_AT:
        for w in list(_in_flight):
            w.is_completed()
        _SWEEP_AT = max(64, 2 * len(_in_flight))
    return work


def settle(grace_s: float = 2.0) -> int:
    """Let pending point-to-point operations complete for up to ``grace_s`` seconds, then
    cancel the rest. Returns how many had to be cancelled (run at exit)."""
    deadline = time.monotonic() + grace_s
    while _in_flight and time.monotonic() < deadline:
        for w in list(_in_flight):
            w.is_completed()
        time.sleep(1e-3)
    left = list(_in_flight)
    for w in left:
        _in_flight.discard(w)
        pending, w._pending = w._pending, None
        if pending is not None and not pending.cancel():
            # MPI may still use the buffers during finalization: never free them (module
            # globals are cleared before MPI is finalized, so a list would not do).
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pending))
    if left:
        sys.stderr.write(f"[commlib] torch backend: {len(left)} point-to-point operation(s) "
                         f"never completed by exit were cancelled\n")
    return len(left)


class _Settler:
    """For :mod:`commlib.mpi.shutdown`: point-to-point handles settled before MPI finalizes
    (cancelled ones keep their buffers alive, so nothing is left running)."""

    def stop_at_exit(self, deadline: float) -> bool:
        settle(min(2.0, max(0.0, deadline - time.monotonic())))
        return True


_settler = _Settler()
shutdown.register(_settler)
