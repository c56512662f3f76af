"""Profiler events of the backend: one ``commlib:<op>`` event per operation.

Under ``torch.profiler.profile`` / ``torch.autograd.profiler.profile`` every operation of
the backend records one event named as gloo names its own (``gloo:all_reduce`` becomes
``commlib:all_reduce``; ``all_gather_into_tensor`` and ``all_gather_coalesced`` record
``commlib:all_gather``, ``all_to_all_single`` ``commlib:all_to_all``, a receive from any
source ``commlib:recvAnySource``, a sparse all-reduce ``commlib:sparse_all_reduce``), with
the operation's input tensors (so ``record_shapes=True`` shows their shapes, as for gloo)
and the metadata torch's C++ backends attach to their ``record_param_comms`` events
(collective name, dtype, message sizes, group name, description, size, ranks and this
rank) as the event's arguments in the exported trace.

The event spans the operation from its start to its completion. Like gloo's, whose events
belong to its ``Work`` objects, it is an asynchronous event: while the profiler is on, a
collective completes on the backend's progress thread (:mod:`.progress`) even when it was
called blocking, so the event ends on another thread than the one that started it, which
is what makes torch's profiler count it as asynchronous (torch offers Python no other way
to mark an event so). Without the profiler nothing of this runs: one check of a flag.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch._C._autograd import _profiler_enabled
from torch._C._profiler import _RecordFunctionFast

enabled = _profiler_enabled


def start(name: str, inputs: Sequence[Any], pg: Any, outputs: Sequence[Any] = ()) -> Any:
    """The open event ``commlib:<name>`` when the profiler is on, else ``None``. ``pg``:
    the process group (for the metadata)."""
    if not _profiler_enabled():
        return None
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    outs = [t for t in outputs if isinstance(t, torch.Tensor)]
    meta = {
        "Collective name": name,
        "dtype": str(tensors[0].dtype).replace("torch.", "") if tensors else "",
        "In msg nelems": sum(t.numel() for t in tensors),
        "Out msg nelems": sum(t.numel() for t in outs) if outs else
        sum(t.numel() for t in tensors),
        "Group size": pg.size(),
        "Rank": pg.rank(),
        "Process Group Name": pg.getGroupName(),
        "Process Group Description": pg.getGroupDesc(),
        "Process Group Ranks": str(list(pg.group.ranks)),
    }
    event = _RecordFunctionFast("commlib:" + name, tensors, meta)
    event.__enter__()
    return event


def end(event: Any) -> None:
    """Close an event :func:`start` opened (``None``: nothing)."""
    if event is not None:
        event.__exit__(None, None, None)
