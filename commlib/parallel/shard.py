"""SplitBrain-style automatic sharding of an existing model's memory-heavy Linear layers."""
from __future__ import annotations

from typing import Any

import torch

from .. import primitives
from ..base.reduce_ops import ReduceOp
from .layers import ColumnParallelLinear, RowParallelLinear

# modules acting elementwise: a column-sharded activation may pass through them unchanged
_ELEMENTWISE = (torch.nn.ReLU, torch.nn.Tanh, torch.nn.GELU, torch.nn.Sigmoid, torch.nn.SiLU,
                torch.nn.LeakyReLU, torch.nn.Identity)


def _big(module: Any, min_params: int) -> bool:
    return type(module) is torch.nn.Linear and \
        sum(p.numel() for p in module.parameters()) >= min_params


def _shared(model: torch.nn.Module) -> set:
    """ids of the modules reachable at more than one place and of the modules holding a
    parameter that is also registered elsewhere (tied weights): sharding one of those
    would give the other places a separate copy."""
    seen_modules: dict = {}
    for _, m in model.named_modules(remove_duplicate=False):
        seen_modules[id(m)] = seen_modules.get(id(m), 0) + 1
    owners: dict = {}
    for _, m in model.named_modules():
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(id(m))
    out = {mid for mid, count in seen_modules.items() if count > 1}
    for mods in owners.values():
        if len(mods) > 1:
            out |= mods
    return out


class _Plan:
    """Which Linear layers may be sharded, and how."""

    def __init__(self, model: torch.nn.Module, group: Any, min_params: int) -> None:
        self.group, self.min_params = group, min_params
        self.shared = _shared(model)

    def ok(self, module: Any) -> bool:
        return _big(module, self.min_params) and id(module) not in self.shared

    def column(self, module: Any) -> bool:
        """``module`` can become a ColumnParallelLinear (enough output features)."""
        return self.ok(module) and module.out_features >= self.group.size

    def row(self, module: Any) -> bool:
        """``module`` can become a RowParallelLinear (enough input features)."""
        return self.ok(module) and module.in_features >= self.group.size


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
    parameters. Sharded parameters are marked with ``param.tensor_parallel = True``.

    Left replicated (unchanged, the same on every rank): a Linear that shares a parameter
    with another module (a language-model head tied to its embedding: the tie stays
    intact), a Linear reachable at two places of the model, and a Linear too narrow to
    split over the group (fewer output features than ranks; for the second of a pair,
    fewer input features). Ties are found within ``model`` (shard the module that holds
    both ends of a tie, not its parts one by one). The plan depends only on the model's
    structure, so it is the same on every rank."""
    group = group if group is not None else primitives.world()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"commlib.parallel.shard_model: argument 'model' must be a "
                        f"torch.nn.Module, got {type(model).__name__}")
    if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 1:
        raise ValueError(f"commlib.parallel.shard_model: argument 'min_params'={min_params!r} "
                         f"must be a positive int")
    _shard(model, _Plan(model, group, min_params))
    return model


def _shard(module: torch.nn.Module, plan: _Plan) -> None:
    group = plan.group
    names = list(module._modules)
    paired: set = set()
    if isinstance(module, torch.nn.Sequential):
        for i, name in enumerate(names):
            child = module._modules[name]
            if name in paired or not plan.column(child):
                continue
            j = i + 1
            while j < len(names) and isinstance(module._modules[names[j]], _ELEMENTWISE):
                j += 1
            if j < len(names) and names[j] not in paired and \
                    plan.row(module._modules[names[j]]):
                _mark(module, name, ColumnParallelLinear.from_linear(child, group, False))
                _mark(module, names[j], RowParallelLinear.from_linear(
                    module._modules[names[j]], group, True))
                paired.update((name, names[j]))
    for name in names:
        child = module._modules[name]
        if name in paired or child is None:
            continue
        if plan.column(child):
            _mark(module, name, ColumnParallelLinear.from_linear(child, group, True))
        elif type(child) is not torch.nn.Linear:
            # (inside a container reachable at two places every Linear counts as shared)
            _shard(child, plan)


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
