"""What every primitive shares: resolving the group, blocking calls under the watchdog,
and finishing reductions (AVG division, copy-back of staged or non-contiguous buffers)."""
from __future__ import annotations

from collections.abc import Callable
from threading import get_ident
from time import monotonic, perf_counter, sleep
from typing import Any

import numpy as np
from mpi4py import MPI

from ..base import accounting
from ..base.buffers import Buf
from ..base.dtypes import bf16_to_f32, f32_to_bf16
from ..base.errors import CommError, where
from ..base.options import options
from ..base.reduce_ops import ReduceOp
from ..core import runtime
from ..core.communicator import Communicator
from .work import Work


def resolve(group: Any, op: str) -> Communicator:
    """The communicator behind ``group`` (``None`` is the world)."""
    if group is None:
        return runtime._world if runtime._world is not None else runtime.world()
    comm = getattr(group, "comm", group)
    if isinstance(comm, Communicator):
        return comm
    if comm is None and hasattr(group, "ranks"):
        raise CommError(f"{where(op, runtime.get_rank())}: this rank is not a member of "
                        f"group with world ranks {list(group.ranks)}")
    raise TypeError(f"{where(op, runtime.get_rank())}: argument 'group' must be a "
                    f"commlib group or None, got {type(group).__name__}")


#: The nonblocking form of each blocking MPI call :func:`blocking` is given, for poll mode
#: (``Communicator.poll_s``); same arguments but the status (its position: name -> index).
_NONBLOCKING = {"Allreduce": "Iallreduce", "Bcast": "Ibcast", "Barrier": "Ibarrier",
                "Reduce": "Ireduce", "Reduce_scatter": "Ireduce_scatter",
                "Allgather": "Iallgather", "Allgatherv": "Iallgatherv",
                "Alltoall": "Ialltoall", "Alltoallv": "Ialltoallv", "Gather": "Igather",
                "Scatter": "Iscatter", "Send": "Isend", "Recv": "Irecv",
                "Sendrecv": None}
_STATUS_AT = {"Recv": 3, "Sendrecv": 6}


def blocking(comm: Communicator, op: str, what: Any, fn: Callable, *args: Any) -> Any:
    """Call a blocking MPI function under the watchdog deadline, timed (``stats()``'s
    ``seconds``, the timeline). In poll mode (``comm.poll_s > 0``, the same on every rank)
    the call's nonblocking form is started and tested, sleeping ``poll_s`` between tests,
    so a rank that waits leaves its core to the others (calls without one block)."""
    return call_blocking(comm, op, what, -1, fn, args)


def call_blocking(comm: Communicator, op: str, what: Any, nbytes: int, fn: Callable,
                  args: tuple) -> Any:
    """:func:`blocking` of ``fn(*args)``; with ``nbytes >= 0`` the call is also counted in
    the byte counters as ``nbytes`` handed to MPI (what ``accounting.record`` counts),
    under the same lock as its time (``accounting.record_timed``): the hot path of small
    collectives."""
    # comm.arm and comm.disarm written out: one thread id, no method calls (every
    # collective comes through here; see commlib.mpi.watchdog for the entry's meaning)
    armed = comm.watchdog.armed
    tid = get_ident()
    armed[tid] = (monotonic() + options.timeout, (op, comm.seq, what, comm))
    t0 = perf_counter()
    try:
        if comm.poll_s and fn.__name__ in _NONBLOCKING:
            return _polled(comm, fn, args)
        return fn(*args)
    finally:
        t1 = perf_counter()
        armed.pop(tid, None)
        if nbytes < 0:
            accounting.timed(op, t0, t1, comm, what, comm.seq)
        else:
            accounting.record_timed(op, nbytes, t0, t1, comm, what)


def _polled(comm: Communicator, fn: Callable, args: tuple) -> None:
    """Poll mode: ``fn``'s nonblocking form, tested every ``comm.poll_s`` seconds."""
    poll_s = comm.poll_s
    name = fn.__name__
    status, at = None, _STATUS_AT.get(name)
    if at is not None and len(args) > at:
        status, args = args[at], args[:at]
    if name == "Sendrecv":
        # MPICH 5.0.2's MPI_Isendrecv fills the status with a wrong count
        # (seen: 1 element for 362): a receive and a send, tested together
        send, dst, stag, recv, src, rtag = args
        reqs = [comm.mpi.Irecv(recv, src, rtag), comm.mpi.Isend(send, dst, stag)]
        statuses = [status if status is not None else MPI.Status(), MPI.Status()]
        while not MPI.Request.Testall(reqs, statuses):
            sleep(poll_s)
        return None
    req = getattr(comm.mpi, _NONBLOCKING[name])(*args)
    while not req.Test(status):
        sleep(poll_s)
    return None


def divide(buf: Buf, n: int) -> None:
    """In-place division by ``n`` (the AVG of a SUM), on host memory or on the device."""
    mem = buf.mem
    if isinstance(mem, np.ndarray):
        if buf.dt.name == "bfloat16":
            mem[...] = f32_to_bf16(bf16_to_f32(mem) / np.float32(n))
        else:
            np.divide(mem, n, out=mem, casting="unsafe")
    elif buf.kind == "torch":
        buf.obj.div_(n)
    else:
        buf.obj /= n


def finish_reduce(buf: Buf, op: ReduceOp, n: int) -> None:
    """Complete an in-place reduction result: AVG division and copy-back, in that order."""
    if op is not ReduceOp.AVG and buf._after is None and buf._staging is None:
        return  # the common case: MPI reduced straight into the caller's memory
    on_host = isinstance(buf.mem, np.ndarray)
    if op is ReduceOp.AVG and on_host:
        divide(buf, n)
    buf.finish()
    if op is ReduceOp.AVG and not on_host:
        divide(buf, n)


def after(request: Any, *bufs: Buf, result: Any = None) -> Any:
    """Stages of a one-request operation: wait for ``request``, finish ``bufs`` (copy-back,
    staging release), then return ``result()`` if callable, else ``result``."""
    yield request
    for buf in bufs:
        buf.finish()
    return result() if callable(result) else result


def out_of_place(comm: Communicator, op: str, buf: Buf, out: Buf, async_op: bool,
                 start: Callable, call: Callable, *args: Any) -> Any:
    """Run an out-of-place collective whose result is ``out.obj``: ``start(*args)`` (the
    non-blocking MPI call) under a :class:`Work` when ``async_op``, else ``call(*args)``
    under the watchdog; both buffers are finished (copy-back, staging release) after."""
    if async_op:
        return Work(comm, op, buf, after(start(*args), buf, out, result=out.obj))
    blocking(comm, op, buf, call, *args)
    buf.finish()
    out.finish()
    return out.obj
