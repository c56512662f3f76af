"""Point-to-point operations of the backend: real non-blocking MPI requests, so that
``isend``/``irecv`` pairs posted in any order never deadlock and ``batch_isend_irecv``
runs every operation at once."""
from __future__ import annotations

from typing import Any

from ..primitives import Group, recv as commlib_recv, recv_any, send as commlib_send
from .convert import where
from .work import CommlibWork, track


def _one(tensors: Any, op: str, rank: int) -> Any:
    if len(tensors) != 1:
        raise ValueError(f"{where(op, rank)}: point-to-point operations take exactly one "
                         f"tensor, got {len(tensors)}")
    return tensors[0]


def send(group: Group, tensors: list, dst: int, tag: int) -> CommlibWork:
    """Start sending ``tensors[0]`` to group rank ``dst``; the tensor must not change until
    the handle completes."""
    tensor = _one(tensors, "send", group.rank)
    pending = commlib_send(tensor.detach(), dst, tag, group, async_op=True)
    return track(CommlibWork(list(tensors), pending))


def recv(group: Group, tensors: list, src: int, tag: int) -> CommlibWork:
    """Start receiving into ``tensors[0]`` from group rank ``src``."""
    tensor = _one(tensors, "recv", group.rank)
    pending = commlib_recv(tensor.detach(), src, tag, group, async_op=True)
    return track(CommlibWork(list(tensors), pending, source=src))


def recv_anysource(group: Group, tensors: list, tag: int) -> CommlibWork:
    """Start receiving into ``tensors[0]`` from whichever rank sends first; the handle's
    ``_source_rank()`` is the sender's group rank once complete."""
    tensor = _one(tensors, "recv", group.rank)
    pending = recv_any(tensor.detach(), tag, group, async_op=True)
    work = CommlibWork(list(tensors), pending)
    work._on_done = work.set_source
    return track(work)
