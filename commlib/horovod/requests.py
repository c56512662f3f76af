"""Submitted operations, their handles and the waits on them (``poll``, ``synchronize``,
:func:`call`); the negotiation itself is :mod:`commlib.horovod.controller`."""
from __future__ import annotations

import itertools
import threading
from typing import Any


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank that took part (Horovod's exception; metadata
    disagreements, operations after another rank joined, shutdown)."""


class Request:
    """One submitted operation (``inputs``/``outputs``: lists of tensors)."""

    __slots__ = ("kind", "name", "meta", "inputs", "outputs", "params", "done", "_event",
                 "error", "result", "controller")

    def __init__(self, kind: str, name: str, meta: tuple, inputs: list, outputs: Any,
                 params: dict) -> None:
        self.kind, self.name, self.meta = kind, name, meta
        self.inputs, self.outputs, self.params = inputs, outputs, params
        self.done = False
        self._event: threading.Event | None = None   # made when a thread waits
        self.error: BaseException | None = None
        self.result: Any = None
        self.controller: Any = None

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done = True
        event = self._event
        if event is not None:
            event.set()

    def wait_done(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for :meth:`finish` (from another thread)."""
        if self._event is None:
            with _event_lock:
                if self._event is None:
                    self._event = threading.Event()
            if self.done:   # finished before the event existed
                return True
        return self._event.wait(timeout) or self.done


_event_lock = threading.Lock()


_handles: dict[int, Request] = {}
_handle_ids = itertools.count(1)
_handles_lock = threading.Lock()


def new_handle(req: Request) -> int:
    with _handles_lock:
        h = next(_handle_ids)
        _handles[h] = req
    return h


def forget_handles() -> None:
    with _handles_lock:
        _handles.clear()


def poll(handle: int) -> bool:
    """True once the operation behind ``handle`` completed (never blocks; without a
    controller thread it does not drive negotiation either)."""
    req = _handles.get(handle)
    if req is None:
        raise ValueError(f"commlib.horovod.poll: unknown handle {handle!r}")
    return req.done


def synchronize(handle: int) -> Any:
    """Wait for the operation behind ``handle``; return its output (the output tensor, a
    list for grouped operations, ``(output, received_splits)`` for alltoall). Raises the
    operation's :class:`HorovodInternalError` on failure. ``None`` for an unknown
    handle, as Horovod."""
    with _handles_lock:
        req = _handles.get(handle)
    if req is None:
        return None
    try:
        req.controller.wait(req)
    finally:
        with _handles_lock:
            _handles.pop(handle, None)
    if req.error is not None:
        raise req.error
    return req.result


_tls = threading.local()


def call(submit: Any, *args: Any, **kwargs: Any) -> Any:
    """``synchronize(submit(*args, **kwargs))`` without a hand-off to the negotiation
    thread: the calling thread drives the rounds itself when the thread is idle."""
    _tls.defer = True
    try:
        req = submit(*args, **kwargs)   # a Request, not a handle, while deferred
    finally:
        _tls.defer = False
    req.controller.wait(req)
    if req.error is not None:
        raise req.error
    return req.result
