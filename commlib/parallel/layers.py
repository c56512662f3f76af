"""Tensor-parallel (Megatron-LM / SplitBrain style) linear layers over a commlib group.

Every rank of the tensor-parallel group sees the same input. Output features (column
parallel) or input features (row parallel) are split into the group's blocks by
:func:`commlib.block_sizes` (the first ``features % k`` ranks hold one more), so any group
size works. Communication is autograd-aware: the backward of each collective runs its
conjugate (all-reduce <-> identity, all-gather <-> slice) on the same group.
"""
from __future__ import annotations

from typing import Any

import torch

from .. import primitives
from ..primitives import block_offsets, block_sizes


def _group(group: Any) -> Any:
    return group if group is not None else primitives.world()


def _gather_last(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate every rank's ``t`` along the last dimension (sizes may differ)."""
    if group.size == 1:
        return t
    front = t.movedim(-1, 0).contiguous()
    parts = group.allgather_v(front)
    return torch.cat(list(parts), dim=0).movedim(0, -1).contiguous()


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous().clone()
        if ctx.group.size > 1:
            ctx.group.allreduce(grad)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        if group.size > 1:
            group.allreduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    """All-gather along the last dimension forward; this rank's slice backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.width = group, x.shape[-1]
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        group = ctx.group
        start = block_offsets(grad.shape[-1], group.size)[group.rank]
        return grad[..., start:start + ctx.width].contiguous(), None


class _ScatterToGroup(torch.autograd.Function):
    """This rank's slice of the last dimension forward; all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        n = x.shape[-1]
        start = block_offsets(n, group.size)[group.rank]
        size = block_sizes(n, group.size)[group.rank]
        return x[..., start:start + size].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _gather_last(grad.contiguous(), ctx.group), None


def _keep_frozen(layer: torch.nn.Module, source: torch.nn.Module) -> None:
    """The sharded parameters require grad where the source's do (frozen stays frozen)."""
    for name, p in layer.named_parameters(recurse=False):
        p.requires_grad_(getattr(source, name).requires_grad)


def _check(group: Any, features: int, what: str) -> None:
    if group.rank < 0:
        raise ValueError(f"commlib.parallel.{what}: this rank is not a member of argument "
                         f"'group'")
    if features < group.size:
        raise ValueError(f"commlib.parallel.{what} (rank {group.rank}): {features} features "
                         f"cannot be split over a group of {group.size} ranks")


class ColumnParallelLinear(torch.nn.Module):
    """``y = x W^T + b`` with the output features split over ``group``.

    ``weight``: this rank's ``(out_k, in_features)`` rows, ``bias``: ``(out_k,)``, where
    ``out_k = block_sizes(out_features, k)[rank]``. Input ``(*, in_features)`` the same on
    every rank. Output ``(*, out_features)`` on every rank (``gather_output=True``, an
    all-gather) or this rank's ``(*, out_k)`` slice (for a following
    :class:`RowParallelLinear` with ``input_is_parallel=True``). The input gradient is
    all-reduced over the group."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 group: Any = None, gather_output: bool = True, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        self.group = _group(group)
        _check(self.group, out_features, "ColumnParallelLinear")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        k, r = self.group.size, self.group.rank
        self.start = block_offsets(out_features, k)[r]
        self.local = block_sizes(out_features, k)[r]
        full = torch.nn.Linear(in_features, out_features, bias, device, dtype)
        self.weight = torch.nn.Parameter(full.weight.detach()[self.start:self.start + self.local]
                                         .clone())
        self.bias = (torch.nn.Parameter(full.bias.detach()[self.start:self.start + self.local]
                                        .clone()) if bias else None)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group: Any = None,
                    gather_output: bool = True) -> ColumnParallelLinear:
        """The sharded equivalent of ``linear`` (whose weights must be the same on every
        rank): this rank keeps its block of rows; ``requires_grad`` as in ``linear``."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group,
                    gather_output, linear.weight.device, linear.weight.dtype)
        with torch.no_grad():
            sl = slice(layer.start, layer.start + layer.local)
            layer.weight.copy_(linear.weight[sl])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias[sl])
        _keep_frozen(layer, linear)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToGroup.apply(x, self.group)
        y = torch.nn.functional.linear(x, self.weight, self.bias)
        return _GatherFromGroup.apply(y, self.group) if self.gather_output else y

    def full_weight(self) -> torch.Tensor:
        """The whole ``(out_features, in_features)`` weight (collective over the group)."""
        return _gather_last(self.weight.detach().t().contiguous(), self.group).t()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(rows {self.start}..{self.start + self.local - 1} here), "
                f"gather_output={self.gather_output}")


class RowParallelLinear(torch.nn.Module):
    """``y = x W^T + b`` with the input features split over ``group``.

    ``weight``: this rank's ``(out_features, in_k)`` columns; ``bias`` ``(out_features,)``
    replicated. Input ``(*, in_features)`` the same on every rank (this rank takes its
    slice) or, with ``input_is_parallel=True``, this rank's ``(*, in_k)`` slice. The
    partial products are all-reduced: output ``(*, out_features)`` on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 group: Any = None, input_is_parallel: bool = False, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        self.group = _group(group)
        _check(self.group, in_features, "RowParallelLinear")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        k, r = self.group.size, self.group.rank
        self.start = block_offsets(in_features, k)[r]
        self.local = block_sizes(in_features, k)[r]
        full = torch.nn.Linear(in_features, out_features, bias, device, dtype)
        self.weight = torch.nn.Parameter(
            full.weight.detach()[:, self.start:self.start + self.local].clone())
        self.bias = torch.nn.Parameter(full.bias.detach().clone()) if bias else None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group: Any = None,
                    input_is_parallel: bool = False) -> RowParallelLinear:
        """The sharded equivalent of ``linear``: this rank keeps its block of columns;
        ``requires_grad`` as in ``linear``."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group,
                    input_is_parallel, linear.weight.device, linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, layer.start:layer.start + layer.local])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias)
        _keep_frozen(layer, linear)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = _ScatterToGroup.apply(x, self.group)
        y = _ReduceFromGroup.apply(torch.nn.functional.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y

    def full_weight(self) -> torch.Tensor:
        """The whole ``(out_features, in_features)`` weight (collective over the group)."""
        return _gather_last(self.weight.detach().contiguous(), self.group)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(columns {self.start}..{self.start + self.local - 1} here), "
                f"input_is_parallel={self.input_is_parallel}")
