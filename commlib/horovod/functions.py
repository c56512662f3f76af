"""Horovod's helpers: ``broadcast_parameters``, ``broadcast_optimizer_state``,
``broadcast_object``, ``allgather_object`` (objects travel pickled, with cloudpickle when
it is installed, as Horovod)."""
from __future__ import annotations

import collections
import io
import pickle
from typing import Any

import torch

from . import state
from .autograd import allgather
from .controller import synchronize
from .ops import broadcast_, broadcast_async_
from .process_sets import ProcessSet, global_process_set

try:
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - cloudpickle is optional
    _pickler = pickle


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Copy ``root_rank``'s tensors into every rank's, in place. ``params``: a
    ``state_dict()``-like dict (sorted by key), or a list of tensors or of ``(name,
    tensor)`` pairs (``model.named_parameters()``). Anything else raises ``ValueError``."""
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, list):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = [broadcast_async_(p.data if isinstance(p, torch.nn.Parameter) else p,
                                root_rank, name) for name, p in params]
    for h in handles:
        synchronize(h)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``obj`` on every rank of ``process_set`` (others' ``obj`` is
    ignored). The default name does not depend on ``obj`` (Horovod's does, so ranks passing
    objects of different types there never match)."""
    name = name or "broadcast_object"
    if state.require("broadcast_object").rank == root_rank:
        buf = io.BytesIO()
        _pickler.dump(obj, buf)
        t = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        sz = torch.tensor([t.numel()], dtype=torch.int64)
        broadcast_(sz, root_rank, name + ".sz", process_set)
    else:
        sz = torch.zeros(1, dtype=torch.int64)
        broadcast_(sz, root_rank, name + ".sz", process_set)
        t = torch.empty(int(sz[0]), dtype=torch.uint8)
    broadcast_(t, root_rank, name + ".t", process_set)
    if state.current.rank != root_rank:
        obj = pickle.loads(t.numpy().tobytes())
    return obj


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    name = name or "allgather_object"
    buf = io.BytesIO()
    _pickler.dump(obj, buf)
    t = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    sizes = allgather(torch.tensor([t.numel()], dtype=torch.int64), name=name + ".sz",
                      process_set=process_set).tolist()
    data = allgather(t, name=name + ".t", process_set=process_set).numpy()
    out, start = [], 0
    for s in sizes:
        out.append(pickle.loads(data[start:start + s].tobytes()))
        start += s
    return out


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Any = None) -> None:
    """Make every rank's optimizer state and hyper-parameters ``root_rank``'s, in place.

    A fresh optimizer has no state yet: like Horovod, every parameter gets a zero gradient
    and one local ``step()`` creates the state (a DistributedOptimizer steps its base class,
    so nothing is exchanged). Tensors of the state travel by broadcast, scalars (step
    counts, hyper-parameters) pickled. ``torch.optim.LBFGS`` raises ``ValueError`` (as
    Horovod). An optimizer that refuses some parameter shapes (torch's ``Muon``: 2-D only)
    has them refused at its construction, so this function sees only what it accepted.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    sparse = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.sparse:
                sparse.update(id(p) for p in m.parameters())
    if len(state_dict["state"]) == 0:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = p.data.new(p.size()).zero_()
                    if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                        p.grad = p.grad.to_sparse()
        base = getattr(optimizer, "_hvd_base_step", None)
        (base or optimizer.step)()
        state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        return
    params, scalars, callbacks = [], {}, {}
    occurrences: dict = collections.defaultdict(int)

    def state_setter(pid: Any, key: Any) -> Any:
        def assign(v: Any) -> None:
            state_dict["state"][pid][key] = v
        return assign

    def option_setter(index: int, key: str) -> Any:
        def assign(v: Any) -> None:
            optimizer.param_groups[index][key] = v
        return assign

    for index, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key == "params":
                continue
            k = f"{key}.{index}"
            scalars[k] = value
            callbacks[k] = option_setter(index, key)
        for pid in group["params"]:
            if pid not in state_dict["state"]:
                continue
            for key, value in state_dict["state"][pid].items():
                occurrences[key] += 1
                k = f"{key}.{occurrences[key]}"
                if torch.is_tensor(value):
                    params.append((k, value))
                else:
                    scalars[k] = value
                    callbacks[k] = state_setter(pid, key)
    # state_dict() tensors are the live state tensors: broadcasting them in place updates
    # the optimizer.
    broadcast_parameters(params, root_rank)
    scalars = broadcast_object(scalars, root_rank)
    for k, v in scalars.items():   # state_dict()'s per-parameter dicts are the live ones
        callbacks[k](v)
