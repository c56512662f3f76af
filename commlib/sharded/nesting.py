"""Nesting of sharded wrappers (torch's auto-wrap pattern: blocks first, then the root).

A wrapper shards the parameters of its *scope*: the modules of its tree that are not
inside a nested wrapper (:func:`commlib.sharded.chunks.scope`). What a nested wrapper
manages (its parameters, its shards, its buffers) is left to it. These checks refuse, with
a message naming the module or parameter, what nesting cannot support; the wrapper raises
them on every rank (it agrees on the outcome first). This module knows nothing of the
wrapper's class: it works on ``(name, module)`` lists and a registry of what live wrappers
shard.
"""
from __future__ import annotations

import weakref
from typing import Any

from torch import nn

# what live wrappers shard: id(original parameter) -> its Slot (weak: gone with the
# wrapper), and module -> a weak reference to the wrapper that registered hooks on it
_PARAMS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_MODULES: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def register(chunks: list[Any], wrapper: Any) -> None:
    """Record the parameters and owner modules of ``chunks`` as sharded by ``wrapper``."""
    ref = weakref.ref(wrapper)
    for c in chunks:
        for s in c.slots:
            _PARAMS[id(s.param)] = s
        for m in c.modules:
            _MODULES[m] = ref


def refusal(inside: list[tuple[str, nn.Module]], nested: list[tuple[str, Any]],
            ranks: tuple[int, ...]) -> str | None:
    """Why a wrapper over the scope ``inside`` (with the nested wrappers ``nested``, on
    the world ranks ``ranks``) cannot be built, or None."""
    for name, w in nested:
        where = f"the nested FullyShardedDataParallel at {name or '(the module itself)'!r}"
        if getattr(w, "_closed", False):
            return f"{where} is closed"
        if tuple(w.process_group.ranks) != tuple(ranks):
            return (f"{where} runs on ranks {list(w.process_group.ranks)}, this wrapper on "
                    f"{list(ranks)}: nested wrappers must use the same ranks")
    under = {}
    for name, w in nested:
        for m in w.modules():
            under.setdefault(id(m), name)
    for name, m in inside:
        if id(m) in under:
            return (f"module {name!r} is both inside the nested FullyShardedDataParallel at "
                    f"{under[id(m)]!r} and outside it: a shared module must be inside one "
                    f"wrapper")
        owner = _MODULES.get(m)
        if owner is not None and owner() is not None:
            return (f"module {name!r} is already sharded by another FullyShardedDataParallel "
                    f"(it does not contain that wrapper): wrap inner modules first, then the "
                    f"outer ones (torch's auto-wrap order)")
        for attr, p in m._parameters.items():
            slot = _PARAMS.get(id(p)) if p is not None else None
            if slot is not None and slot.param is p:
                full = f"{name}.{attr}" if name else attr
                return (f"parameter {full!r} is shared with a parameter already managed by "
                        f"another FullyShardedDataParallel ({slot.name!r} there): tied "
                        f"parameters must be inside one wrapper (wrap a module that holds "
                        f"every use)")
    return None
