"""A model as a graph of nodes with measured costs, for :func:`commlib.pipeline.partition`.

:func:`trace` turns a module into a ``torch.fx.GraphModule`` (a plain ``nn.Sequential`` by
its children, without tracing; anything else by ``torch.fx.symbolic_trace``) whose one
placeholder is the pipeline's input. Tied ``nn.Linear`` / ``nn.Embedding`` weights become
functional calls on one shared ``get_attr`` node, so that a tie is a value like any other
(it can travel between stages). :func:`profile` runs the graph on the example input (and on
a smaller batch, to tell batch dimensions apart) and measures each node. Pure compute: no
communication here.
"""
from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

PREFIX = "commlib.pipeline.partition"


class _NamingTracer(fx.Tracer):
    """fx's tracer that remembers which module it is inside, to name it in errors."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.proxy_buffer_attributes = True   # buffers as get_attr nodes, like parameters

    def call_module(self, m: torch.nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            name = self.path_of_module(m)
        except NameError:
            name = type(m).__name__
        self.stack.append(name)
        out = super().call_module(m, forward, args, kwargs)
        self.stack.pop()   # left in place on an error: the innermost module is the culprit
        return out


def _sequential_graph(model: torch.nn.Sequential) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    for name, child in model._modules.items():   # (named_children skips repeats)
        if child is not None:
            x = graph.call_module(name, (x,))
    graph.output(x)
    return fx.GraphModule(model, graph)


def trace(model: torch.nn.Module, prefix: str = PREFIX) -> fx.GraphModule:
    """``model`` as a GraphModule whose parameters, buffers and submodules are ``model``'s
    own objects (nothing is copied). Raises ``TypeError`` naming the innermost module that
    fx cannot trace, and ``ValueError`` for a forward with more than one tensor input (the
    pipeline feeds its first stage one tensor) or an output that is not one tensor; error
    messages start with ``prefix``."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{prefix}: argument 'model' must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if type(model) is torch.nn.Sequential:
        if len(model) == 0:
            raise ValueError(f"{prefix}: argument 'model' is an empty nn.Sequential")
        return _untie(_sequential_graph(model))
    params = list(inspect.signature(model.forward).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional:
        raise ValueError(f"{prefix}: forward of {type(model).__name__} takes no positional "
                         f"input; the pipeline feeds its first stage one tensor")
    concrete = {}
    for p in params[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is inspect.Parameter.empty:
            raise ValueError(f"{prefix}: forward of {type(model).__name__} needs input "
                             f"{p.name!r} besides {positional[0].name!r}; the pipeline "
                             f"feeds its first stage one tensor (give the others defaults)")
        concrete[p.name] = p.default
    tracer = _NamingTracer()
    try:
        graph = tracer.trace(model, concrete_args=concrete or None)
    except Exception as exc:   # fx raises many kinds (TraceError, TypeError, ...)
        inner = tracer.stack[-1] if tracer.stack else "the top-level module"
        raise TypeError(f"{prefix}: torch.fx cannot trace {type(model).__name__}: the error "
                        f"arose in module {inner!r}: {type(exc).__name__}: {exc}. Make it "
                        f"traceable (no data-dependent control flow) or pass an "
                        f"nn.Sequential of its parts") from exc
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for extra in places[1:]:
        # a concrete arg leaves a placeholder feeding only fx's checks of its value
        reach, todo = [], [extra]
        while todo:
            node = todo.pop()
            if node not in reach:
                reach.append(node)
                todo.extend(node.users)
        if any(u not in reach for node in reach for u in node.users) or \
                any(node.op == "output" for node in reach):
            raise ValueError(f"{prefix}: forward of {type(model).__name__} uses input "
                             f"{extra.name!r}; the pipeline feeds its first stage one tensor")
        order = {node: i for i, node in enumerate(gm.graph.nodes)}
        for node in sorted(reach, key=order.get, reverse=True):
            gm.graph.erase_node(node)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    if not isinstance(out.args[0], fx.Node):
        raise ValueError(f"{prefix}: forward of {type(model).__name__} returns "
                         f"{type(out.args[0]).__name__}; a pipeline's last stage returns one "
                         f"tensor")
    gm.recompile()
    return _untie(gm)


def _functional(node: fx.Node, module: torch.nn.Module, read: Any) -> Any:
    """``(function, args)`` equal to ``module(node's input)`` (an ``nn.Linear`` or
    ``nn.Embedding``), its parameters read by ``read(name)`` (a ``get_attr`` node)."""
    x = node.args[0] if node.args else node.kwargs.get("input")
    weight = read("weight")
    if type(module) is torch.nn.Linear:
        bias = read("bias") if module.bias is not None else None
        return torch.nn.functional.linear, (x, weight, bias)
    if type(module) is torch.nn.Embedding:
        return torch.nn.functional.embedding, (x, weight, module.padding_idx, module.max_norm,
                                               module.norm_type, module.scale_grad_by_freq,
                                               module.sparse)
    raise AssertionError(type(module))


def _path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _untie(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ties so that each shared parameter is read by one ``get_attr`` node: calls
    of an ``nn.Linear`` / ``nn.Embedding`` whose weight is also used elsewhere become
    ``F.linear`` / ``F.embedding`` of that node, and repeated ``get_attr`` nodes of one
    tensor become the first. Other ties are left as they are (the partitioner keeps their
    users in one stage or refuses by name)."""
    owners: dict = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            for name, p in gm.get_submodule(node.target).named_parameters():
                owners.setdefault(id(p), set()).add(node)
        elif node.op == "get_attr":
            owners.setdefault(id(_attr(gm, node.target)), set()).add(node)
    first: dict = {}
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "get_attr":
            value = _attr(gm, node.target)
            if not isinstance(value, torch.nn.Parameter):
                # a buffer: one read per user, so that each stage reading it holds it
                for user in list(node.users)[1:]:
                    with gm.graph.inserting_before(user):
                        user.replace_input_with(node, gm.graph.get_attr(node.target))
                changed = True
                continue
            key = id(value)
            if key in first:
                node.replace_all_uses_with(first[key])
                gm.graph.erase_node(node)
                changed = True
            else:
                first[key] = node
            continue
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or len(owners.get(id(weight), ())) < 2 \
                or type(module) not in (torch.nn.Linear, torch.nn.Embedding):
            continue

        def read(name: str, node: fx.Node = node, module: torch.nn.Module = module) -> fx.Node:
            value = getattr(module, name)
            if id(value) not in first:
                first[id(value)] = gm.graph.get_attr(_path(node.target, name))
            return first[id(value)]
        with gm.graph.inserting_before(node):
            call = _functional(node, module, read)
            new = gm.graph.call_function(call[0], call[1])
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return gm


def _attr(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class NodeInfo:
    """One compute node: its output on the example batch (``value``), whether each output
    tensor's dim 0 is the batch (``batched``: True, False when its shape does not depend on
    the batch, None when neither), its output bytes, the bytes of the parameters it reads
    first, the parameters it reads (``id -> (name, parameter)``), and its measured forward+backward
    seconds (median over repetitions)."""
    node: fx.Node
    value: Any
    batched: Any
    out_bytes: int
    param_bytes: int
    params: dict
    seconds: float = 0.0


def _bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_bytes(v) for v in value.values())
    return 0


def _batched(big: Any, small: Any, b: int, b2: int) -> Any:
    if not isinstance(big, torch.Tensor):
        return None
    if big.shape == small.shape:
        return False
    if big.dim() >= 1 and big.shape[0] == b and small.shape[0] == b2 \
            and big.shape[1:] == small.shape[1:]:
        return True
    return None


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        self.values[n] = out
        return out


def _run(gm: fx.GraphModule, x: torch.Tensor) -> dict:
    rec = _Recorder(gm)
    with torch.no_grad():
        rec.run(x)
    return rec.values


def _leaves(value: Any, out: list) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _leaves(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _leaves(v, out)


def _time_node(gm: fx.GraphModule, node: fx.Node, values: dict) -> float:
    """Seconds of one forward and backward of the node on the recorded inputs (float
    inputs as fresh leaves that require grad; parameters as they are; nothing accumulates
    into ``.grad``)."""
    if node.op == "get_attr":
        return 0.0
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        params = [p for p in module.parameters() if p.requires_grad]
    else:
        params = []
    leaves: list = []

    def fresh(v: Any) -> Any:
        if isinstance(v, fx.Node):
            v = values[v]
            if isinstance(v, torch.nn.Parameter):
                if v.requires_grad:
                    params.append(v)
                return v
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                leaf = v.detach().requires_grad_(True)
                leaves.append(leaf)
                return leaf.clone()
            return v.clone() if isinstance(v, torch.Tensor) else v
        return v
    args = fx.node.map_aggregate(node.args, fresh)
    kwargs = fx.node.map_aggregate(node.kwargs, fresh)
    wrt = leaves + list(dict.fromkeys(params))
    start = time.perf_counter()
    with torch.enable_grad():
        if node.op == "call_module":
            out = gm.get_submodule(node.target)(*args, **kwargs)
        elif node.op == "call_function":
            out = node.target(*args, **kwargs)
        else:   # call_method
            out = getattr(args[0], node.target)(*args[1:], **kwargs)
        outs: list = []
        _leaves(out, outs)
        outs = [o for o in outs if o.requires_grad]
        if outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs],
                                allow_unused=True)
    return time.perf_counter() - start


def profile(gm: fx.GraphModule, example: torch.Tensor, measure_time: bool,
            repeats: int = 3) -> list[NodeInfo]:
    """The compute nodes of ``gm`` in topological order with their costs on ``example``
    (batch first, at least 2 rows). Buffers, the RNG state and ``.grad`` of the model are
    as before when it returns (BatchNorm statistics and dropout are not disturbed)."""
    b = example.shape[0]
    b2 = b - 1 if b > 2 else 1
    buffers = [(t, t.detach().clone()) for t in gm.buffers()]
    rng = torch.get_rng_state()
    try:
        values = _run(gm, example)
        small = _run(gm, example[:b2])
        infos = []
        seen: set = set()
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            params: dict = {}
            if node.op == "call_module":
                module = gm.get_submodule(node.target)
                for name, t in module.named_parameters():
                    params[id(t)] = (_path(node.target, name), t)
            elif node.op == "get_attr" and isinstance(values[node], torch.nn.Parameter):
                params[id(values[node])] = (node.target, values[node])
            param_bytes = sum(_bytes(t) for key, (_, t) in params.items() if key not in seen)
            seen.update(params)
            infos.append(NodeInfo(node, values[node], _batched(values[node], small[node], b, b2),
                                  _bytes(values[node]), param_bytes, params))
        if measure_time:
            # repetitions round-robin over the nodes (a burst of interference from other
            # processes hits different nodes in different rounds); the first is a warm-up
            samples: list = [[] for _ in infos]
            for _ in range(repeats + 1):
                for info, times in zip(infos, samples):
                    times.append(_time_node(gm, info.node, values))
            for info, times in zip(infos, samples):
                info.seconds = statistics.median(times[1:])
    finally:
        with torch.no_grad():
            for t, saved in buffers:
                t.copy_(saved)
        torch.set_rng_state(rng)
    return infos
