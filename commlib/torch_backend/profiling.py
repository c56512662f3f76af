"""Profiler events of the backend: one ``commlib:<op>`` event per operation.

Under ``torch.profiler.profile`` / ``torch.autograd.profiler.profile`` every operation of
the backend records one event named as gloo names its own (``gloo:all_reduce`` becomes
``commlib:all_reduce``; ``all_gather_into_tensor`` and ``all_gather_coalesced`` record
``commlib:all_gather``, ``reduce_scatter_tensor`` ``commlib:reduce_scatter``,
``all_to_all_single`` ``commlib:all_to_all``, a receive from any source
``commlib:recvAnySource``, a sparse all-reduce ``commlib:sparse_all_reduce``), with the
operation's input tensors (so ``record_shapes=True`` shows their shapes, as for gloo) and
the metadata torch's C++ backends attach to their ``record_param_comms`` events
(collective name, dtype, message sizes, group name, description, size, ranks and this
rank) as the event's arguments in the exported trace.

The event spans the operation from its start to its completion and, like gloo's (which
belong to its ``Work`` objects), it is an asynchronous event: it ends on another thread
than the one that started it, which is what makes torch's profiler count it as
asynchronous (torch offers Python no other way to mark an event so). The end must run
with the starting thread's thread-local state (the profiler's state lives there; gloo's
``Work`` propagates it the same way): it runs as a task of torch's inter-op thread pool
forked from the starting thread (a TorchScript ``fork`` of a Python function, which
propagates that state). A blocking operation forks the end once complete and waits for it
(tens of microseconds, only while a profiler is on); an operation completed elsewhere (the
progress thread) forks at its start a task that waits for its completion (bounded by the
group's timeout) and then ends the event. Without a profiler all this costs one check of a
flag. (No ``from __future__ import annotations`` here: TorchScript reads the annotations
of the forked function.)
"""
import itertools
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch._C._autograd import _profiler_enabled
from torch._C._profiler import _RecordFunctionFast

enabled = _profiler_enabled

#: token -> (open event, completion to wait for or None, seconds to wait at most)
_open: dict[int, tuple] = {}
_tokens = itertools.count()
_lock = threading.Lock()
_forker: Any = None


@torch.jit.ignore
def _close(token: int) -> int:
    """Run in torch's inter-op pool, with the starting thread's thread-local state."""
    event, done, wait_s = _open.pop(token)
    if done is not None:
        done.wait(wait_s)
    event.__exit__(None, None, None)
    return token


def _fork_close(token: int) -> Any:
    global _forker
    if _forker is None:
        with _lock:
            if _forker is None:
                def fork_close(token: int) -> torch.jit.Future[int]:
                    return torch.jit.fork(_close, token)
                _forker = torch.jit.script(fork_close)
    return _forker(token)


class Event:
    """An open ``commlib:<op>`` profiler event (see the module docstring)."""

    __slots__ = ("record", "closing")

    def __init__(self, record: Any) -> None:
        self.record = record
        self.closing: Any = None

    def end(self) -> None:
        """End it now (the operation completed in this thread); returns once recorded."""
        if self.closing is None:
            token = next(_tokens)
            _open[token] = (self.record, None, 0.0)
            self.closing = _fork_close(token)
        self.closing.wait()

    def end_when(self, done: threading.Event, wait_s: float) -> None:
        """End it once ``done`` is set (or after ``wait_s`` seconds), from now on."""
        token = next(_tokens)
        _open[token] = (self.record, done, min(wait_s, 1e6))
        self.closing = _fork_close(token)

    def ended(self) -> None:
        """Wait until an :meth:`end_when` ending was recorded."""
        if self.closing is not None:
            self.closing.wait()


def start(name: str, inputs: Sequence[Any], pg: Any,
          outputs: Sequence[Any] = ()) -> "Event | None":
    """The open event ``commlib:<name>`` when the profiler is on, else ``None``. ``pg``:
    the process group (for the metadata)."""
    if not _profiler_enabled():
        return None
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    outs = [t for t in outputs if isinstance(t, torch.Tensor)] or tensors
    meta = {
        "Collective name": name,
        "dtype": str(tensors[0].dtype).replace("torch.", "") if tensors else "",
        "In msg nelems": sum(t.numel() for t in tensors),
        "Out msg nelems": sum(t.numel() for t in outs),
        "Group size": pg.size(),
        "Rank": pg.rank(),
        "Process Group Name": pg.getGroupName(),
        "Process Group Description": pg.getGroupDesc(),
        "Process Group Ranks": str(list(pg.group.ranks)),
    }
    record = _RecordFunctionFast("commlib:" + name, tensors, meta)
    record.__enter__()
    return Event(record)


def end(event: "Event | None") -> None:
    """End ``event`` now (``None``: nothing)."""
    if event is not None:
        event.end()
