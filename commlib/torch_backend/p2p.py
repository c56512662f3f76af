"""Point-to-point operations of the backend: real non-blocking MPI requests, so that
``isend``/``irecv`` pairs posted in any order never deadlock and ``batch_isend_irecv``
runs every operation at once. Each handle completes within the group's timeout
(:mod:`.deadlines`: a receive that timed out is cancelled) and records a ``commlib:send``,
``commlib:recv`` or ``commlib:recvAnySource`` profiler event (:mod:`.profiling`; while the
profiler is on, the progress thread completes the operation, so that the event is an
asynchronous one, as gloo's)."""
from __future__ import annotations

from typing import Any

from ..primitives import recv as commlib_recv, recv_any, send as commlib_send
from . import profiling, progress
from .convert import dense, where
from .work import CommlibWork, track


def _profiled(pg: Any, pending: Any, tensors: list, op: str, event: Any, deadline: float,
              source: int = -1, any_source: bool = False) -> Any:
    """The handle of a point-to-point operation the progress thread completes."""
    work: Any = None

    def record_source(value: Any) -> None:
        work.set_source(value)
    work = progress.submit(pending, list(tensors), record_source if any_source else None,
                           pg._deadlines, op, deadline, event, collective=False,
                           source=source)
    return work


def _one(tensors: Any, op: str, rank: int) -> Any:
    if len(tensors) != 1:
        raise ValueError(f"{where(op, rank)}: point-to-point operations take exactly one "
                         f"tensor, got {len(tensors)}")
    dense(tensors, op, rank)
    return tensors[0]


def send(pg: Any, tensors: list, dst: int, tag: int) -> CommlibWork:
    """Start sending ``tensors[0]`` to group rank ``dst`` of process group ``pg``; the
    tensor must not change until the handle completes."""
    tensor = _one(tensors, "send", pg.group.rank)
    event = profiling.start("send", tensors, pg)
    deadline = pg._deadlines.deadline()
    pending = commlib_send(tensor.detach(), dst, tag, pg.group, async_op=True)
    if event is not None and pg._background:
        return _profiled(pg, pending, tensors, "send", event, deadline)
    return track(CommlibWork(list(tensors), pending, deadlines=pg._deadlines, op="send",
                             event=event))


def recv(pg: Any, tensors: list, src: int, tag: int) -> CommlibWork:
    """Start receiving into ``tensors[0]`` from group rank ``src``."""
    tensor = _one(tensors, "recv", pg.group.rank)
    event = profiling.start("recv", tensors, pg)
    deadline = pg._deadlines.deadline()
    pending = commlib_recv(tensor.detach(), src, tag, pg.group, async_op=True)
    if event is not None and pg._background:
        return _profiled(pg, pending, tensors, "recv", event, deadline, source=src)
    return track(CommlibWork(list(tensors), pending, source=src, deadlines=pg._deadlines,
                             op="recv", event=event))


def recv_anysource(pg: Any, tensors: list, tag: int) -> CommlibWork:
    """Start receiving into ``tensors[0]`` from whichever rank sends first; the handle's
    ``_source_rank()`` is the sender's group rank once complete."""
    tensor = _one(tensors, "recv", pg.group.rank)
    event = profiling.start("recvAnySource", tensors, pg)
    deadline = pg._deadlines.deadline()
    pending = recv_any(tensor.detach(), tag, pg.group, async_op=True)
    if event is not None and pg._background:
        return _profiled(pg, pending, tensors, "recv", event, deadline, any_source=True)
    work = CommlibWork(list(tensors), pending, deadlines=pg._deadlines, op="recv",
                       event=event)
    work._on_done = work.set_source
    return track(work)
