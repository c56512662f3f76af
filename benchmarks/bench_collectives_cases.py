"""The cases of bench_collectives: for each operation, one commlib call and its raw mpi4py
equivalent on the same memory (uppercase buffer methods, prebuilt ``[buf, count, type]``
messages, preallocated outputs, on the peer's own ``COMM_WORLD.Dup()``).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

OPS = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter", "alltoall",
       "pingpong")
DTYPES = {"float32": "FLOAT", "float64": "DOUBLE", "int32": "INT32_T", "int64": "INT64_T"}


# -- buffers and cases -------------------------------------------------------------------
class Ctx:
    """The raw peer communicator and how to make buffers of the benchmarked kind."""

    def __init__(self, args: argparse.Namespace) -> None:
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()
        self.rank, self.n = self.comm.Get_rank(), self.comm.Get_size()
        self.dtype = np.dtype(args.dtype)
        self.mpitype = getattr(MPI, DTYPES[args.dtype])   # predefined, as commlib uses
        self.torch = args.torch
        self.fresh_output = args.fresh_output

    def buffer(self, count: int) -> tuple[Any, np.ndarray]:
        """(object handed to commlib, numpy view of the same memory)."""
        if self.torch:
            import torch
            t = torch.from_numpy(np.zeros(count, dtype=self.dtype))
            return t, t.numpy()
        a = np.zeros(count, dtype=self.dtype)
        return a, a

    def out(self, shape: tuple) -> tuple[Any, np.ndarray]:
        """(commlib's ``out=`` object or None with --fresh-output, raw peer's array)."""
        if self.torch:
            import torch
            t = torch.from_numpy(np.empty(shape, dtype=self.dtype))
            return (None if self.fresh_output else t), t.numpy()
        a = np.empty(shape, dtype=self.dtype)
        return (None if self.fresh_output else a), a

    def msg(self, arr: np.ndarray, count: int | None = None) -> list:
        return [arr, arr.size if count is None else count, self.mpitype]


@dataclass
class Case:
    lib: Callable[[], Any]       # one commlib call (or ping-pong round trip); returns result
    raw: Callable[[], Any]       # the same with raw mpi4py
    arr: np.ndarray              # input memory (filled for the check, zeroed for timing)
    count: int                   # elements per rank
    alg_scale: int = 1           # algbw bytes = input bytes x alg_scale (allgather: n)
    time_scale: float = 1.0      # ping-pong: one-way latency = round trip / 2


def case_allreduce(ctx: Ctx, count: int) -> Case:
    import commlib
    obj, arr = ctx.buffer(count)
    msg, IN_PLACE, SUM = ctx.msg(arr), ctx.MPI.IN_PLACE, ctx.MPI.SUM

    def raw() -> Any:
        ctx.comm.Allreduce(IN_PLACE, msg, SUM)
        return arr
    return Case(lambda: commlib.allreduce(obj), raw, arr, count)


def case_reduce(ctx: Ctx, count: int) -> Case:
    import commlib
    obj, arr = ctx.buffer(count)
    msg = ctx.msg(arr)
    send, recv = (ctx.MPI.IN_PLACE, msg) if ctx.rank == 0 else (msg, None)

    def raw() -> Any:
        ctx.comm.Reduce(send, recv, ctx.MPI.SUM, 0)
        return arr
    return Case(lambda: commlib.reduce(obj, dst=0), raw, arr, count)


def case_broadcast(ctx: Ctx, count: int) -> Case:
    import commlib
    obj, arr = ctx.buffer(count)
    msg = ctx.msg(arr)

    def raw() -> Any:
        ctx.comm.Bcast(msg, 0)
        return arr
    return Case(lambda: commlib.broadcast(obj, src=0), raw, arr, count)


def case_allgather(ctx: Ctx, count: int) -> Case:
    import commlib
    obj, arr = ctx.buffer(count)
    mine, out = ctx.out((ctx.n, count))
    send, recv = ctx.msg(arr), ctx.msg(out, count)

    def raw() -> Any:
        ctx.comm.Allgather(send, recv)
        return out
    return Case(lambda: commlib.allgather(obj, out=mine), raw, arr, count, alg_scale=ctx.n)


def case_reduce_scatter(ctx: Ctx, count: int) -> Case:
    import commlib
    obj, arr = ctx.buffer(count)
    counts = commlib.block_sizes(count, ctx.n)
    mine, out = ctx.out((counts[ctx.rank],))
    send, recv = ctx.msg(arr), ctx.msg(out)

    def raw() -> Any:
        ctx.comm.Reduce_scatter(send, recv, counts, ctx.MPI.SUM)
        return out
    return Case(lambda: commlib.reduce_scatter(obj, out=mine), raw, arr, count)


def elements(ctx: Ctx, op: str, nbytes: int) -> int:
    """Elements per rank for a nominal size (alltoall: whole elements for every rank)."""
    count = max(1, nbytes // ctx.dtype.itemsize)
    return -(-count // ctx.n) * ctx.n if op == "alltoall" else count


def case_alltoall(ctx: Ctx, count: int) -> Case:
    import commlib
    obj, arr = ctx.buffer(count)
    mine, out = ctx.out((count,))
    send, recv = ctx.msg(arr, count // ctx.n), ctx.msg(out, count // ctx.n)

    def raw() -> Any:
        ctx.comm.Alltoall(send, recv)
        return out
    return Case(lambda: commlib.alltoall(obj, out=mine), raw, arr, count)


def case_pingpong(ctx: Ctx, count: int) -> Case:
    """Ranks 0 and 1 bounce one buffer (send then recv / recv then send); others idle."""
    import commlib
    obj, arr = ctx.buffer(count)
    msg, c = ctx.msg(arr), ctx.comm
    peer = {0: 1, 1: 0}.get(ctx.rank)

    def lib() -> Any:
        if peer == 1:
            commlib.send(obj, 1)
            commlib.recv(obj, 1)
        elif peer == 0:
            commlib.recv(obj, 0)
            commlib.send(obj, 0)
        return arr

    def raw() -> Any:
        if peer == 1:
            c.Send(msg, 1)
            c.Recv(msg, 1)
        elif peer == 0:
            c.Recv(msg, 0)
            c.Send(msg, 0)
        return arr
    return Case(lib, raw, arr, count, time_scale=0.5)


CASES = {name: globals()[f"case_{name}"] for name in OPS}
#: The operations the shared-memory tier serves (``--shm``).
SHM_OPS = ("allreduce", "broadcast", "allgather", "reduce_scatter")
