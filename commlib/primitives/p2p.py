"""Point-to-point: send and recv between two ranks of a group."""
from __future__ import annotations

from typing import Any

from mpi4py import MPI

from ..base import accounting
from ..base.buffers import Buf, adapt
from ..base.errors import CommError, where
from ..core.communicator import Communicator
from ._base import after, blocking, resolve
from .work import Work


def _check_tag(tag: Any, op: str, rank: int) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"{where(op, rank)}: argument 'tag' must be an int, "
                        f"got {type(tag).__name__}")
    upper = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    assert upper is not None  # every MPI sets it on COMM_WORLD
    if not 0 <= tag <= upper:
        raise ValueError(f"{where(op, rank)}: argument 'tag'={tag} must be in 0..{upper} "
                         f"(MPI_TAG_UB)")
    return tag


def send(tensor: Any, dst: int, tag: int = 0, group: Any = None,
         async_op: bool = False) -> Any:
    """Send ``tensor`` to rank ``dst`` of ``group``; the matching :func:`recv` on ``dst``
    names this rank as ``src`` and the same ``tag``. The buffer is only read; with
    ``async_op=True`` it must not be modified until the :class:`Work` completes."""
    comm = resolve(group, "send")
    rank = comm.rank
    dst = comm.check_rank(dst, "dst", "send")
    tag = _check_tag(tag, "send", rank)
    buf = adapt(tensor, "tensor", "send", rank)
    accounting.record("send", buf.nbytes, comm.size)
    if async_op:
        return Work(comm, "send", buf, after(comm.mpi.Isend(buf.msg(), dst, tag), buf))
    blocking(comm, "send", buf, comm.mpi.Send, buf.msg(), dst, tag)
    buf.finish()
    return None


def recv(tensor: Any, src: int, tag: int = 0, group: Any = None,
         async_op: bool = False) -> Any:
    """Receive into ``tensor`` (in place) a message from rank ``src`` of ``group``.

    The message must have exactly ``tensor``'s number of elements and dtype: a longer one
    raises (MPI's truncation error), a shorter one raises :class:`CommError` instead of
    leaving part of the buffer stale. Returns ``tensor`` (or a :class:`Work`).
    """
    comm = resolve(group, "recv")
    rank = comm.rank
    src = comm.check_rank(src, "src", "recv")
    tag = _check_tag(tag, "recv", rank)
    buf = adapt(tensor, "tensor", "recv", rank, write=True, read=False)
    accounting.record("recv", buf.nbytes, comm.size)
    status = MPI.Status()
    if async_op:
        request = comm.mpi.Irecv(buf.msg(), src, tag)
        return Work(comm, "recv", buf, _recv_stages(request, comm, buf, src, tensor))
    blocking(comm, "recv", buf, comm.mpi.Recv, buf.msg(), src, tag, status)
    _check_count(status, comm, buf, src)
    buf.finish()
    return tensor


def recv_any(tensor: Any, tag: int = 0, group: Any = None, async_op: bool = False) -> Any:
    """Receive into ``tensor`` (in place) the next message with ``tag`` from any rank of
    ``group``; returns the sender's rank in ``group`` (or a :class:`Work` whose ``wait()``
    returns it). Same size rule as :func:`recv`."""
    comm = resolve(group, "recv")
    rank = comm.rank
    tag = _check_tag(tag, "recv", rank)
    buf = adapt(tensor, "tensor", "recv", rank, write=True, read=False)
    accounting.record("recv", buf.nbytes, comm.size)
    if async_op:
        request = comm.mpi.Irecv(buf.msg(), MPI.ANY_SOURCE, tag)
        return Work(comm, "recv", buf, _recv_stages(request, comm, buf, None, None))
    status = MPI.Status()
    blocking(comm, "recv", buf, comm.mpi.Recv, buf.msg(), MPI.ANY_SOURCE, tag, status)
    source = status.Get_source()
    _check_count(status, comm, buf, source)
    buf.finish()
    return source


def _recv_stages(request: Any, comm: Communicator, buf: Buf, src: int | None,
                 tensor: Any) -> Any:
    """Stages of a receive: check the count, copy back; return ``tensor``, or the sender's
    rank when ``src`` is None (any source)."""
    status = yield request
    source = status.Get_source() if src is None else src
    _check_count(status, comm, buf, source)
    buf.finish()
    return source if src is None else tensor


def _check_count(status: Any, comm: Communicator, buf: Buf, src: int) -> None:
    got = status.Get_count(buf.dt.mpi)
    if got != buf.count:
        raise CommError(f"{where('recv', comm.rank)}: rank {src} sent {got} elements of "
                        f"{buf.dt.name}, but the receive buffer holds {buf.count}")


def sendrecv(send_tensor: Any, dst: int, recv_tensor: Any, src: int, tag: int = 0,
             group: Any = None) -> Any:
    """Send ``send_tensor`` to ``dst`` and receive into ``recv_tensor`` from ``src`` at once
    (MPI_Sendrecv: no deadlock when every rank of a ring or pair calls it). The two buffers
    must not overlap; the received message must have ``recv_tensor``'s element count.
    Returns ``recv_tensor``."""
    comm = resolve(group, "sendrecv")
    rank = comm.rank
    dst = comm.check_rank(dst, "dst", "sendrecv")
    src = comm.check_rank(src, "src", "sendrecv")
    tag = _check_tag(tag, "sendrecv", rank)
    out = adapt(send_tensor, "send_tensor", "sendrecv", rank)
    into = adapt(recv_tensor, "recv_tensor", "sendrecv", rank, write=True, read=False)
    accounting.record("sendrecv", out.nbytes, comm.size)
    status = MPI.Status()
    blocking(comm, "sendrecv", out, comm.mpi.Sendrecv, out.msg(), dst, tag, into.msg(), src,
             tag, status)
    _check_count(status, comm, into, src)
    out.finish()
    into.finish()
    return recv_tensor
