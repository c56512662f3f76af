"""SplitBrain-style automatic sharding of an existing model's memory-heavy Linear layers."""
from __future__ import annotations

from typing import Any

import torch

from .. import primitives
from ..reduce_ops import ReduceOp
from .layers import ColumnParallelLinear, RowParallelLinear

# modules acting elementwise: a column-sharded activation may pass through them unchanged
_ELEMENTWISE = (torch.nn.ReLU, torch.nn.Tanh, torch.nn.GELU, torch.nn.Sigmoid, torch.nn.SiLU,
                torch.nn.LeakyReLU, torch.nn.Identity)


def _big(module: Any, min_params: int) -> bool:
    return type(module) is torch.nn.Linear and \
        sum(p.numel() for p in module.parameters()) >= min_params


def shard_model(model: torch.nn.Module, group: Any = None,
                min_params: int = 1 << 20) -> torch.nn.Module:
    """Replace, in place, every ``torch.nn.Linear`` of ``model`` with at least
    ``min_params`` parameters (weight and bias) by a tensor-parallel equivalent over
    ``group`` (default: the world), splitting its current weights; returns ``model``.

    Collective over ``group``; the model's weights must be the same on every rank of it
    (they usually are after seeding or a broadcast). Inside a ``torch.nn.Sequential``, a big
    Linear followed (through elementwise activations only) by another big Linear becomes a
    :class:`ColumnParallelLinear` without gather and a :class:`RowParallelLinear` on its
    slice (one all-reduce for the pair, as in Megatron-LM's MLP); any other big Linear
    becomes a :class:`ColumnParallelLinear` that gathers its output. The model computes the
    same function (up to rounding) and each rank holds about ``1/k`` of those layers'
    parameters. Sharded parameters are marked with ``param.tensor_parallel = True``."""
    group = group if group is not None else primitives.world()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"commlib.parallel.shard_model: argument 'model' must be a "
                        f"torch.nn.Module, got {type(model).__name__}")
    if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 1:
        raise ValueError(f"commlib.parallel.shard_model: argument 'min_params'={min_params!r} "
                         f"must be a positive int")
    _shard(model, group, min_params)
    return model


def _shard(module: torch.nn.Module, group: Any, min_params: int) -> None:
    names = list(module._modules)
    paired: set = set()
    if isinstance(module, torch.nn.Sequential):
        for i, name in enumerate(names):
            child = module._modules[name]
            if name in paired or not _big(child, min_params):
                continue
            j = i + 1
            while j < len(names) and isinstance(module._modules[names[j]], _ELEMENTWISE):
                j += 1
            if j < len(names) and _big(module._modules[names[j]], min_params):
                _mark(module, name, ColumnParallelLinear.from_linear(child, group, False))
                _mark(module, names[j], RowParallelLinear.from_linear(
                    module._modules[names[j]], group, True))
                paired.update((name, names[j]))
    for name in names:
        child = module._modules[name]
        if name in paired or child is None:
            continue
        if _big(child, min_params):
            _mark(module, name, ColumnParallelLinear.from_linear(child, group, True))
        else:
            _shard(child, group, min_params)


def _mark(parent: torch.nn.Module, name: str, layer: torch.nn.Module) -> None:
    for p in layer.parameters():
        p.tensor_parallel = True
    if isinstance(layer, RowParallelLinear) and layer.bias is not None:
        layer.bias.tensor_parallel = False  # replicated
    parent._modules[name] = layer


def allreduce_gradients(model: torch.nn.Module, group: Any = None,
                        shard_group: Any = None) -> None:
    """Data-parallel gradient averaging for a sharded model: the gradients of replicated
    parameters are averaged over ``group`` (default: the world), those of sharded
    parameters (``tensor_parallel``) over ``shard_group`` (the ranks holding the same
    shard, e.g. ``Topology(...).group("dp")``; None: not exchanged). In place."""
    group = group if group is not None else primitives.world()
    for p in model.parameters():
        if p.grad is None:
            continue
        g = shard_group if getattr(p, "tensor_parallel", False) else group
        if g is not None and g.size > 1:
            g.allreduce(p.grad, op=ReduceOp.AVG)
