"""Point-to-point operations of the backend: real non-blocking MPI requests, so that
``isend``/``irecv`` pairs posted in any order never deadlock and ``batch_isend_irecv``
runs every operation at once. Each handle completes within the group's timeout
(:mod:`.deadlines`: a receive that timed out is cancelled) and records a ``commlib:send``,
``commlib:recv`` or ``commlib:recvAnySource`` profiler event (:mod:`.profiling`), ended
where the operation completes."""
from __future__ import annotations

from typing import Any

from ..primitives import recv as commlib_recv
from ..primitives import recv_any
from ..primitives import send as commlib_send
from . import profiling
from .convert import dense, where
from .work import CommlibWork, track


def _one(tensors: Any, op: str, rank: int) -> Any:
    if len(tensors) != 1:
        raise ValueError(f"{where(op, rank)}: point-to-point operations take exactly one "
                         f"tensor, got {len(tensors)}")
    dense(tensors, op, rank)
    return tensors[0]


def _start(event: Any, start: Any, *args: Any) -> Any:
    """``start(*args)``; the profiler event ends if it raises."""
    try:
        return start(*args)
    except BaseException:
        profiling.end(event)
        raise


def send(pg: Any, tensors: list, dst: int, tag: int) -> CommlibWork:
    """Start sending ``tensors[0]`` to group rank ``dst`` of process group ``pg``; the
    tensor must not change until the handle completes."""
    tensor = _one(tensors, "send", pg.group.rank)
    event = profiling.start("send", tensors, pg)
    pending = _start(event, commlib_send, tensor.detach(), dst, tag, pg.group, True)
    return track(CommlibWork(list(tensors), pending, deadlines=pg._deadlines, op="send",
                             event=event))


def recv(pg: Any, tensors: list, src: int, tag: int) -> CommlibWork:
    """Start receiving into ``tensors[0]`` from group rank ``src``."""
    tensor = _one(tensors, "recv", pg.group.rank)
    event = profiling.start("recv", tensors, pg)
    pending = _start(event, commlib_recv, tensor.detach(), src, tag, pg.group, True)
    return track(CommlibWork(list(tensors), pending, source=src, deadlines=pg._deadlines,
                             op="recv", event=event))


def recv_anysource(pg: Any, tensors: list, tag: int) -> CommlibWork:
    """Start receiving into ``tensors[0]`` from whichever rank sends first; the handle's
    ``_source_rank()`` is the sender's group rank once complete."""
    tensor = _one(tensors, "recv", pg.group.rank)
    event = profiling.start("recvAnySource", tensors, pg)
    pending = _start(event, recv_any, tensor.detach(), tag, pg.group, True)
    work = CommlibWork(list(tensors), pending, deadlines=pg._deadlines, op="recv",
                       event=event)
    work._on_done = work.set_source
    return track(work)
