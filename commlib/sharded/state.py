"""Full (unsharded) state dicts of a :class:`FullyShardedDataParallel` module and its
optimizer, and param groups over shards. A full state does not depend on the world size or
the strategy, so a state saved at N ranks loads at any other number.

The module state follows torch's module protocol (state-dict and load-state-dict hooks on
the wrapper, as torch's FSDP does), so ``parent.state_dict()`` of a model holding wrappers
at any depth, nested or not, has exactly the keys of the unwrapped model, and
``parent.load_state_dict`` loads them. This module knows nothing of the wrapper's class:
the wrapper hands it its chunks and two callables (gather a chunk, put views back).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .chunks import Chunk, Slot

# (chunk, tensor shaped like its shard) -> the whole flat chunk (collective when sharded)
Gather = Callable[[Chunk, torch.Tensor], torch.Tensor]


def parse_param_groups(module: nn.Module, groups: list[dict] | None, rank: int,
                       scope: set[int] | None = None) -> tuple[list[dict], dict[int, int]]:
    """(options of each entry, id(param) -> entry index + 1) for the constructor's
    ``param_groups`` (parameters not named by any entry map to 0). ``scope``: ids of the
    parameters this wrapper shards (others, e.g. a nested wrapper's, are refused)."""
    if groups is None:
        return [], {}
    by_name = dict(module.named_parameters(remove_duplicate=False))
    known = {id(p) for p in by_name.values()} if scope is None else scope
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
                                 f"which is not a parameter this wrapper shards")
            if id(p) in group_of and group_of[id(p)] != i + 1:
                raise ValueError(f"FullyShardedDataParallel (rank {rank}): a parameter is "
                                 f"in param_groups[{group_of[id(p)] - 1}] and [{i}]")
            group_of[id(p)] = i + 1
        options.append({k: v for k, v in entry.items() if k != "params"})
    return options, group_of


def sharded_param_groups(chunks: list[Chunk], options: list[dict],
                         others: list[nn.Parameter] = ()) -> list[dict]:
    """``options`` over the shards of ``chunks`` (by entry), then one group without options
    for the shards no entry named and ``others`` (nested wrappers' shards)."""
    out = [{**opt, "params": [c.shard for c in chunks if c.group_index == i + 1]}
           for i, opt in enumerate(options)]
    rest = [c.shard for c in chunks if c.group_index == 0] + list(others)
    if rest or not out:
        out.append({"params": rest})
    return out


def record_names(modules: list[nn.Module]) -> dict[int, list[str]]:
    """id(module) -> names of the parameters it registered, in registration order."""
    return {id(m): [a for a, p in m._parameters.items() if p is not None] for m in modules}


def _slice(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
    return flat[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()


def _rename(keys: list[str], prefix: str, inner: str) -> None:
    """In place: drop ``prefix + "_flat_params."`` keys, strip ``inner`` after ``prefix``."""
    out = []
    for k in keys:
        rest = k[len(prefix):] if k.startswith(prefix) else None
        if rest is not None and rest.startswith("_flat_params."):
            continue
        out.append(prefix + rest[len(inner):] if rest is not None and rest.startswith(inner)
                   else k)
    keys[:] = out


class FullStateHooks:
    """torch's state-dict protocol for a wrapper whose wrapped module is its child
    ``inner`` and whose shards sit in its child ``_flat_params``.

    Saving: a pre-hook gathers the chunks and registers each parameter (a full, detached
    copy) on its module again; torch's recursion writes them where the unwrapped module
    would, under ``prefix + inner``; the post-hook removes the registrations, drops the
    shards' keys and strips ``inner`` (keys and ``_metadata``: the stripped versions are
    added beside the others). Loading: a pre-hook adds ``inner`` to the keys under
    ``prefix`` and registers full copies (the current values) as targets for torch's own
    loading (shape checks, missing and unexpected keys, ``assign``); the post-hook cuts
    this rank's shards out of them, removes the registrations and names the keys as the
    unwrapped module does. Collective over the wrapper's group (the gathers). A module
    whose parameters the wrapper holds refuses a state dict (or a load) asked of it
    directly, which would lack them."""

    def __init__(self, wrapper: nn.Module, inner: str, chunks: list[Chunk],
                 names: dict[int, list[str]], gather: Gather,
                 restore: Callable[[Chunk], None]) -> None:
        self.chunks, self.names, self.gather, self.restore = chunks, names, gather, restore
        self.inner = inner + "."
        self._loading: list[str] = []

        def post_save(module: nn.Module, destination: Any, prefix: str, meta: Any) -> None:
            self._post_save(destination, prefix)

        def post_load(module: nn.Module, incompatible: Any) -> None:
            self._post_load(incompatible)

        self._saving = 0
        self.handles = [wrapper.register_state_dict_pre_hook(self._pre_save),
                        wrapper.register_state_dict_post_hook(post_save),
                        wrapper.register_load_state_dict_pre_hook(self._pre_load),
                        wrapper.register_load_state_dict_post_hook(post_load)]
        # a module whose parameters the wrapper holds, asked directly, would silently
        # lack them: it refuses instead
        for m in {id(m): m for c in chunks for m in c.modules}.values():
            self.handles += [m.register_state_dict_pre_hook(self._guard),
                             m.register_load_state_dict_pre_hook(self._guard)]

    def _guard(self, module: nn.Module, *args: Any) -> None:
        if not self._saving and not self._loading:
            raise RuntimeError(
                f"FullyShardedDataParallel: {type(module).__name__}'s parameters are sharded "
                f"(it is inside a FullyShardedDataParallel): take the state dict, or load "
                f"it, through the wrapper or a module holding it")

    # -- registrations ------------------------------------------------------------------
    @torch.no_grad()
    def _full_values(self) -> dict[int, torch.Tensor]:
        """id(slot) -> a full copy of its parameter (collective: gathers every chunk)."""
        values = {}
        for c in self.chunks:
            flat = self.gather(c, c.shard)
            for s in c.slots:
                values[id(s)] = _slice(flat, s)
        return values

    def _register(self, values: dict[int, torch.Tensor]) -> None:
        params = {id(s): nn.Parameter(values[id(s)], requires_grad=s.param.requires_grad)
                  for c in self.chunks for s in c.slots}
        slot_of = {(id(m), a): s for c in self.chunks for s in c.slots for m, a in s.owners}
        for m in {id(m): m for c in self.chunks for m in c.modules}.values():
            for attr in self.names.get(id(m), ()):
                m._parameters[attr] = params[id(slot_of[(id(m), attr)])]

    def _unregister(self) -> None:
        for c in self.chunks:
            for m in c.modules:
                for attr in self.names.get(id(m), ()):
                    m._parameters.pop(attr, None)
            self.restore(c)

    # -- saving -------------------------------------------------------------------------
    def _pre_save(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self._register(self._full_values())
        self._saving += 1

    def _post_save(self, destination: Any, prefix: str) -> None:
        self._saving -= 1
        self._unregister()
        # the wrapper's entries are the last ones written: re-append them renamed, in order
        for k in [k for k in destination if k.startswith(prefix)]:
            value, renamed = destination.pop(k), [k]
            _rename(renamed, prefix, self.inner)
            if renamed:
                destination[renamed[0]] = value
        meta = getattr(destination, "_metadata", None)
        if meta is not None:
            inner = prefix + self.inner[:-1]
            for k in list(meta):
                if k == inner:
                    meta[prefix[:-1]] = meta[k]
                elif k.startswith(inner + "."):
                    meta[prefix + k[len(inner) + 1:]] = meta[k]
                elif k == prefix + "_flat_params":
                    del meta[k]

    # -- loading ------------------------------------------------------------------------
    def _pre_load(self, module: nn.Module, state_dict: Any, prefix: str, meta: Any,
                  strict: bool, missing: list, unexpected: list, errors: list) -> None:
        for k in [k for k in state_dict if k.startswith(prefix)]:
            state_dict[prefix + self.inner + k[len(prefix):]] = state_dict.pop(k)
        self._register(self._full_values())
        self._loading.append(prefix)

    @torch.no_grad()
    def _scatter(self) -> None:
        for c in self.chunks:
            values = []
            for s in c.slots:
                m, attr = s.owners[-1]   # with assign=True each owner got its own tensor
                values.append(m._parameters[attr].detach())
            flat = c.flatten(values)
            lo = c.rank * c.shard_numel if c.shards > 1 else 0
            c.shard.copy_(flat[lo:lo + c.shard_numel])

    def _post_load(self, incompatible: Any) -> None:
        prefix = self._loading.pop()
        try:
            self._scatter()
        finally:
            self._unregister()
        _rename(incompatible.missing_keys, prefix, self.inner)
        _rename(incompatible.unexpected_keys, prefix, self.inner)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# -- the optimizer's full state ----------------------------------------------------------
# ``named``: (chunk, the names of its slots in the unwrapped model) for every chunk the
# optimizer may hold, this wrapper's and its nested wrappers'.

def _elementwise(key: str, value: Any, shape: torch.Size) -> bool:
    return isinstance(value, torch.Tensor) and key != "step" and value.shape == shape


@torch.no_grad()
def full_optim_state_dict(named: list[tuple[Chunk, list[str]]], gather: Gather, rank: int,
                          optim: torch.optim.Optimizer) -> dict:
    chunk_of = {id(c.shard): (c, names) for c, names in named}
    state: dict[str, dict] = {}
    groups = []
    for g in optim.param_groups:
        group_names = []
        for p in g["params"]:
            if id(p) not in chunk_of:
                raise ValueError(f"FullyShardedDataParallel.optim_state_dict (rank "
                                 f"{rank}): the optimizer holds a tensor that is not a "
                                 f"shard of this module")
            c, names = chunk_of[id(p)]
            group_names += names
            for key, value in optim.state.get(p, {}).items():
                if _elementwise(key, value, p.shape):
                    flat = gather(c, value)
                    for s, name in zip(c.slots, names):
                        state.setdefault(name, {})[key] = _slice(flat, s)
                else:
                    for name in names:
                        v = value.clone() if isinstance(value, torch.Tensor) else value
                        state.setdefault(name, {})[key] = v
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": group_names})
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def shard_optim_state_dict(named: list[tuple[Chunk, list[str]]], rank: int,
                           optim: torch.optim.Optimizer, full: dict) -> dict:
    chunk_of = {id(c.shard): (c, names) for c, names in named}
    saved = full["state"]
    if len(full["param_groups"]) != len(optim.param_groups):
        raise ValueError(f"FullyShardedDataParallel.optim_state_dict_to_load (rank "
                         f"{rank}): the state has {len(full['param_groups'])} param "
                         f"groups, the optimizer {len(optim.param_groups)}")
    state, groups, index = {}, [], 0
    for g, sg in zip(optim.param_groups, full["param_groups"]):
        ids = []
        for p in g["params"]:
            c, names = chunk_of[id(p)]
            first = saved.get(names[0])
            if first is not None:
                entry = {}
                for key, value in first.items():
                    if _elementwise(key, value, c.slots[0].shape):
                        flat = c.flatten([saved[name][key] for name in names])
                        lo = c.rank * c.shard_numel if c.shards > 1 else 0
                        entry[key] = flat[lo:lo + c.shard_numel].clone()
                    else:
                        entry[key] = value
                state[index] = entry
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in sg.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}
