"""Horovod's differentiable collectives (``allreduce``, ``allgather``, ``broadcast``,
``alltoall``, ``reducescatter`` and their grouped forms), with Horovod's backward passes:

* allreduce: the gradient is an allreduce of the output gradient with the same op and
  scale factors;
* allgather: the gradient is the *average* over ranks of the output gradient, narrowed to
  this rank's rows;
* broadcast: the averaged output gradient on the root, zeros elsewhere;
* alltoall: an alltoall of the output gradient with the received splits;
* reducescatter: an allgather of the output gradient (times the set size for ``Sum``,
  times the scale factors).

The backward collectives are negotiated like any other (auto names), so every rank must
run the backward pass.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import ops, state
from .compression import Compression
from .controller import call
from .execute import Average, Sum
from .process_sets import ProcessSet, global_process_set


class HorovodAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, average: Any, name: Any, op: Any,
                pre: float, post: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.args = (average, op, pre, post, process_set)
        return call(ops.allreduce_async, tensor, average, name, op, pre, post,
                                               process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        average, op, pre, post, ps = ctx.args
        g = allreduce(grad.contiguous(), average=average, op=op, prescale_factor=pre,
                      postscale_factor=post, process_set=ps)
        return (g,) + (None,) * 6


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over ``process_set``; returns a new tensor (same shape, dtype,
    device), differentiable. ``compression`` compresses before the exchange and
    decompresses after it."""
    if compression is Compression.none and not (tensor.requires_grad
                                                and torch.is_grad_enabled()):
        # the common blocking case: no compression, no graph (skip both wrappers)
        return ops.allreduce_blocking(tensor, average, name,
                                      Average if op is None and average is None else op,
                                      prescale_factor, postscale_factor, process_set, False)
    compressed, cctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        out = HorovodAllreduce.apply(compressed, average, name, op, prescale_factor,
                                     postscale_factor, process_set)
    else:   # no graph to record: skip autograd.Function's own cost
        out = ops.allreduce_blocking(compressed, average, name,
                                     Average if op is None and average is None else op,
                                     prescale_factor, postscale_factor, process_set, False)
    return compression.decompress(out, cctx)


class HorovodGroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, average: Any, name: Any, op: Any, pre: float, post: float,
                process_set: ProcessSet, *tensors: torch.Tensor) -> tuple:
        ctx.args = (average, op, pre, post, process_set)
        return tuple(call(ops.grouped_allreduce_async, list(tensors), average, name, op,
                                                             pre, post, process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        average, op, pre, post, ps = ctx.args
        g = grouped_allreduce([x.contiguous() for x in grads], average=average, op=op,
                              prescale_factor=pre, postscale_factor=post, process_set=ps)
        return (None,) * 6 + tuple(g)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none,
                      op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list:
    """Allreduce of a list of tensors as one operation; returns a list of new tensors."""
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor,
                                         process_set, *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def _my_offset(dims: list, process_set: ProcessSet) -> list:
    """Row offset of this rank's part in each gathered tensor (one allgather of the first
    dimensions)."""
    t = torch.tensor(dims, dtype=torch.int64).reshape(1, -1)
    table = call(ops.allgather_async, t, process_set=process_set)
    me = process_set.rank() if process_set is not global_process_set else state.current.rank
    return [int(table[:me, k].sum()) for k in range(len(dims))]


class HorovodAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, process_set: ProcessSet) -> torch.Tensor:
        ctx.dim = tensor.shape[0] if tensor.dim() else 1
        ctx.scalar = tensor.dim() == 0
        ctx.process_set = process_set
        return call(ops.allgather_async, tensor, name, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = allreduce(grad.contiguous(), op=Average, process_set=ctx.process_set)
        offset = _my_offset([ctx.dim], ctx.process_set)[0]
        g = reduced.narrow(0, offset, ctx.dim)
        return (g.reshape(()) if ctx.scalar else g), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0 (first dimensions may
    differ); a new tensor, differentiable."""
    return HorovodAllgather.apply(tensor, name, process_set)


class HorovodGroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Any, process_set: ProcessSet, *tensors: torch.Tensor) -> tuple:
        ctx.dims = [t.shape[0] for t in tensors]
        ctx.process_set = process_set
        return tuple(call(ops.grouped_allgather_async, list(tensors), name, process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=Average,
                                    process_set=ctx.process_set)
        offsets = _my_offset(ctx.dims, ctx.process_set)
        return (None, None) + tuple(r.narrow(0, o, d)
                                    for r, o, d in zip(reduced, offsets, ctx.dims))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list:
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


class HorovodBroadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Any,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return call(ops.broadcast_async, tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = allreduce(grad.contiguous(), op=Average, process_set=ctx.process_set)
        if state.current.rank != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``root_rank``'s tensor on every rank (a new tensor), differentiable."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return HorovodBroadcast.apply(tensor, root_rank, name, process_set)
    return call(ops.broadcast_async, tensor, root_rank, name, process_set)


class HorovodAlltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Any,
                process_set: ProcessSet) -> Any:
        out, received = call(ops.alltoall_async, tensor, splits, name, process_set)
        ctx.process_set, ctx.received = process_set, received
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *ignored: Any) -> tuple:
        g, _ = call(ops.alltoall_async, grad.contiguous(), ctx.received,
                                              process_set=ctx.process_set)
        if g.shape[0] < ctx.rows:   # rows past sum(splits) were not sent: zero gradient
            g = torch.cat([g, g.new_zeros((ctx.rows - g.shape[0],) + tuple(g.shape[1:]))])
        return g, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Alltoall along dimension 0; returns ``output`` when ``splits`` is None, else
    ``(output, received_splits)``, as Horovod. Differentiable."""
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


class HorovodReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, op: int, process_set: ProcessSet,
                pre: float, post: float) -> torch.Tensor:
        ctx.args = (op, process_set, pre, post)
        return call(ops.reducescatter_async, tensor, name, op, process_set, pre, post)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        op, ps, pre, post = ctx.args
        g = _scatter_grad(grad, op, ps, pre, post)
        return allgather(g.contiguous(), process_set=ps), None, None, None, None, None


def _scatter_grad(grad: torch.Tensor, op: int, ps: ProcessSet, pre: float,
                  post: float) -> torch.Tensor:
    if op == Sum:
        grad = grad * (ps.size() if ps is not global_process_set else state.current.size)
    if pre != 1.0:
        grad = grad * pre
    if post != 1.0:
        grad = grad * post
    return grad


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: Any = Compression.none, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over ``process_set`` and keep this rank's rows (Horovod's uneven split);
    a new tensor, differentiable."""
    compressed, cctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor,
                                     postscale_factor)
    return compression.decompress(out, cctx)


class HorovodGroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Any, op: int, process_set: ProcessSet, pre: float, post: float,
                *tensors: torch.Tensor) -> tuple:
        ctx.args = (op, process_set, pre, post)
        return tuple(call(ops.grouped_reducescatter_async, list(tensors), name, op,
                                                                 process_set, pre, post))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        op, ps, pre, post = ctx.args
        gs = [_scatter_grad(g, op, ps, pre, post).contiguous() for g in grads]
        return (None,) * 5 + tuple(grouped_allgather(gs, process_set=ps))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list:
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                             postscale_factor, *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]
