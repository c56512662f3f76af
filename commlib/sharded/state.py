"""Full (unsharded) state dicts of a :class:`FullyShardedDataParallel` module and its
optimizer, and param groups over shards. A full state does not depend on the world size or
the strategy, so a state saved at N ranks loads at any other number."""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..primitives import allgather
from .chunks import Chunk, Slot

if TYPE_CHECKING:
    from .fsdp import FullyShardedDataParallel


def parse_param_groups(module: nn.Module, groups: list[dict] | None,
                       rank: int) -> tuple[list[dict], dict[int, int]]:
    """(options of each entry, id(param) -> entry index + 1) for the constructor's
    ``param_groups`` (parameters not named by any entry map to 0)."""
    if groups is None:
        return [], {}
    by_name = dict(module.named_parameters(remove_duplicate=False))
    known = {id(p) for p in by_name.values()}
    options, group_of = [], {}
    for i, entry in enumerate(groups):
        if not isinstance(entry, dict) or "params" not in entry:
            raise TypeError(f"FullyShardedDataParallel (rank {rank}): param_groups[{i}] must "
                            f"be a dict with a 'params' entry, got {type(entry).__name__}")
        for item in entry["params"]:
            p = by_name.get(item) if isinstance(item, str) else item
            if p is None or id(p) not in known:
                raise ValueError(f"FullyShardedDataParallel (rank {rank}): param_groups[{i}] "
                                 f"names {item if isinstance(item, str) else 'a tensor'!r}, "
                                 f"which is not a parameter of the module")
            if id(p) in group_of and group_of[id(p)] != i + 1:
                raise ValueError(f"FullyShardedDataParallel (rank {rank}): a parameter is "
                                 f"in param_groups[{group_of[id(p)] - 1}] and [{i}]")
            group_of[id(p)] = i + 1
        options.append({k: v for k, v in entry.items() if k != "params"})
    return options, group_of


def sharded_param_groups(chunks: list[Chunk], options: list[dict]) -> list[dict]:
    out = [{**opt, "params": [c.shard for c in chunks if c.group_index == i + 1]}
           for i, opt in enumerate(options)]
    rest = [c.shard for c in chunks if c.group_index == 0]
    if rest or not out:
        out.append({"params": rest})
    return out


def record_names(module: nn.Module) -> dict[int, list[str]]:
    """id(module) -> names of the parameters it registered, in registration order."""
    return {id(m): [a for a, p in m._parameters.items() if p is not None]
            for m in module.modules()}


def _entries(fsdp: "FullyShardedDataParallel", prefix: str) -> "OrderedDict[str, Any]":
    """state-dict name -> ("param", slot) or ("buffer", module, name), in the order of
    ``module.state_dict()``."""
    slot_of = {(id(m), a): s for c in fsdp._chunks for s in c.slots for m, a in s.owners}
    out: OrderedDict[str, Any] = OrderedDict()

    def visit(m: nn.Module, pre: str) -> None:
        for attr in fsdp._names.get(id(m), ()):
            out[pre + attr] = ("param", slot_of[(id(m), attr)])
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out[pre + name] = ("buffer", m, name)
        for name, child in m._modules.items():
            if child is not None:
                visit(child, pre + name + ".")

    visit(fsdp.module, prefix)
    return out


def _full_chunk(fsdp: "FullyShardedDataParallel", c: Chunk, t: torch.Tensor) -> torch.Tensor:
    """The whole flat chunk of a shard-shaped tensor ``t`` (collective when sharded)."""
    if c.shards == 1:
        return t.detach()
    return fsdp._run(allgather, t.detach().contiguous(), fsdp.process_group).reshape(-1)


def _slice(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
    return flat[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()


@torch.no_grad()
def full_state_dict(fsdp: "FullyShardedDataParallel", prefix: str) -> "OrderedDict[str, Any]":
    values: dict[int, torch.Tensor] = {}
    for c in fsdp._chunks:
        flat = _full_chunk(fsdp, c, c.shard)
        for s in c.slots:
            values[id(s)] = _slice(flat, s)
    out: OrderedDict[str, Any] = OrderedDict()
    for name, entry in _entries(fsdp, prefix).items():
        if entry[0] == "param":
            out[name] = values[id(entry[1])]
        else:
            out[name] = entry[1]._buffers[entry[2]].detach()
    return out


@torch.no_grad()
def load_full_state_dict(fsdp: "FullyShardedDataParallel", state_dict: Any,
                         strict: bool) -> Any:
    from torch.nn.modules.module import _IncompatibleKeys
    entries = _entries(fsdp, "")
    missing = [k for k in entries if k not in state_dict]
    unexpected = [k for k in state_dict if k not in entries]
    if strict and (missing or unexpected):
        raise RuntimeError(f"Error(s) in loading state_dict for FullyShardedDataParallel "
                           f"(rank {fsdp.rank}): missing keys {missing}, unexpected keys "
                           f"{unexpected}")
    names: dict[int, list[str]] = {}
    for name, entry in entries.items():
        if entry[0] == "param":
            names.setdefault(id(entry[1]), []).append(name)
        elif name in state_dict:
            entry[1]._buffers[entry[2]].copy_(state_dict[name])
    for c in fsdp._chunks:
        present = [next((state_dict[n] for n in names[id(s)] if n in state_dict), None)
                   for s in c.slots]
        if any(v is None for v in present):
            if all(v is None for v in present):
                continue
            present = [s.param if v is None else v for s, v in zip(c.slots, present)]
            present = [_current(fsdp, c, s) if v is s.param else v
                       for s, v in zip(c.slots, present)]
        for s, v in zip(c.slots, present):
            if tuple(v.shape) != tuple(s.shape):
                raise RuntimeError(f"Error(s) in loading state_dict for FullyShardedDataParallel"
                                   f" (rank {fsdp.rank}): size mismatch for {s.name}: "
                                   f"{tuple(v.shape)} given, {tuple(s.shape)} expected")
        flat = c.flatten(present)
        lo = fsdp.rank * c.shard_numel if c.shards > 1 else 0
        c.shard.copy_(flat[lo:lo + c.shard_numel])
    return _IncompatibleKeys(missing, unexpected)


def _current(fsdp: "FullyShardedDataParallel", c: Chunk, s: Slot) -> torch.Tensor:
    return _slice(_full_chunk(fsdp, c, c.shard), s)


def _chunk_of(fsdp: "FullyShardedDataParallel") -> dict[int, Chunk]:
    return {id(c.shard): c for c in fsdp._chunks}


def _elementwise(key: str, value: Any, shape: torch.Size) -> bool:
    return isinstance(value, torch.Tensor) and key != "step" and value.shape == shape


@torch.no_grad()
def full_optim_state_dict(fsdp: "FullyShardedDataParallel",
                          optim: torch.optim.Optimizer) -> dict:
    chunk_of = _chunk_of(fsdp)
    state: dict[str, dict] = {}
    groups = []
    for g in optim.param_groups:
        names = []
        for p in g["params"]:
            c = chunk_of.get(id(p))
            if c is None:
                raise ValueError(f"FullyShardedDataParallel.optim_state_dict (rank "
                                 f"{fsdp.rank}): the optimizer holds a tensor that is not a "
                                 f"shard of this module")
            names += [s.name for s in c.slots]
            for key, value in optim.state.get(p, {}).items():
                if _elementwise(key, value, p.shape):
                    flat = _full_chunk(fsdp, c, value)
                    for s in c.slots:
                        state.setdefault(s.name, {})[key] = _slice(flat, s)
                else:
                    for s in c.slots:
                        v = value.clone() if isinstance(value, torch.Tensor) else value
                        state.setdefault(s.name, {})[key] = v
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def shard_optim_state_dict(fsdp: "FullyShardedDataParallel", optim: torch.optim.Optimizer,
                           full: dict) -> dict:
    chunk_of = _chunk_of(fsdp)
    saved = full["state"]
    if len(full["param_groups"]) != len(optim.param_groups):
        raise ValueError(f"FullyShardedDataParallel.optim_state_dict_to_load (rank "
                         f"{fsdp.rank}): the state has {len(full['param_groups'])} param "
                         f"groups, the optimizer {len(optim.param_groups)}")
    state, groups, index = {}, [], 0
    for g, sg in zip(optim.param_groups, full["param_groups"]):
        ids = []
        for p in g["params"]:
            c = chunk_of[id(p)]
            first = saved.get(c.slots[0].name)
            if first is not None:
                entry = {}
                for key, value in first.items():
                    if _elementwise(key, value, c.slots[0].shape):
                        flat = c.flatten([saved[s.name][key] for s in c.slots])
                        lo = fsdp.rank * c.shard_numel if c.shards > 1 else 0
                        entry[key] = flat[lo:lo + c.shard_numel].clone()
                    else:
                        entry[key] = value
                state[index] = entry
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in sg.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}
