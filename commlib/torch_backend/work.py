"""Handles the backend returns to torch: ``torch.distributed.Work`` objects whose
``wait()`` and ``get_future()`` both complete the operation.

Collectives run to completion before the call returns (see
:mod:`commlib.torch_backend.process_group`), so their handles are born complete.
Point-to-point operations are real non-blocking MPI requests (so paired
``isend``/``irecv`` never deadlock): ``wait()`` completes them under commlib's watchdog,
and ``get_future()`` does the same before it returns a completed future, because torch's
DDP waits on the future, and with MPI nothing makes progress unless someone calls into
it; ``is_completed()`` tests without blocking.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch._C._distributed_c10d import Work

from ..primitives import Work as CommlibPending


class CommlibWork(Work):
    """``result`` is the list of tensors the operation wrote (or read, for a send); it is
    the value of the future. ``pending``: a commlib :class:`commlib.Work` still to
    complete; ``on_done(value)`` runs once with its ``wait()`` value (recv from any source
    records the sender this way)."""

    def __init__(self, result: list, pending: CommlibPending | None = None,
                 on_done: Callable[[Any], None] | None = None, source: int = -1) -> None:
        super().__init__()
        self._result = result
        self._pending = pending
        self._on_done = on_done
        self._source = source
        self._future: torch.futures.Future | None = None

    def _complete(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            value = pending.wait()
            if self._on_done is not None:
                self._on_done(value)

    def wait(self, timeout: Any = None) -> bool:
        """Block until the operation is complete (commlib's watchdog bounds the wait)."""
        self._complete()
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


def done(tensors: list) -> CommlibWork:
    """The handle of a completed operation."""
    return CommlibWork(list(tensors))
