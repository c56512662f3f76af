"""Automatic pipeline partitioning (Merak's graph sharding): cut a model's traced graph into
contiguous stages that balance time (or parameter bytes), ready for :class:`Pipeline`.

A stage takes and returns one tensor (what :class:`Pipeline` carries). Where more than one
value must reach later stages (a skip connection, a tied weight), the stage packs them into
one flat tensor of their common dtype and the next stage unpacks them: a value whose dim 0
is the batch keeps its per-sample shape (the micro-batch size is solved from the length),
one whose shape does not depend on the batch (a weight read by a later stage) keeps its
shape. Places where that cannot work (a non-tensor value such as ``x.size(1)`` crossing,
values of different dtypes, a parameter read on both sides) are never cut.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from .. import primitives
from ..base.errors import where
from ..base.reduce_ops import ReduceOp
from .trace import PREFIX, profile, trace

BALANCES = ("time", "params")


def _pack(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Several tensors of one dtype as one flat tensor (gradients flow through)."""
    return torch.cat([v.reshape(-1) for v in values])


def _unpack(flat: torch.Tensor, spec: tuple) -> tuple:
    """Inverse of :func:`_pack`: ``spec`` is ``((shape, batched), ...)``, ``shape`` the
    per-sample shape of a batched value, else the whole shape."""
    per = sum(math.prod(s) for s, batched in spec if batched)
    fixed = sum(math.prod(s) for s, batched in spec if not batched)
    rows = (flat.numel() - fixed) // per if per else 0
    if per and rows * per + fixed != flat.numel():
        raise ValueError(f"{PREFIX}: a stage received {flat.numel()} elements, which is not "
                         f"{fixed} + k * {per}: not the tensor its previous stage packs")
    out, offset = [], 0
    for shape, batched in spec:
        full = (rows, *shape) if batched else tuple(shape)
        n = math.prod(full)
        out.append(flat[offset:offset + n].view(full))
        offset += n
    return tuple(out)


class Partition(list):
    """The stage modules (a list of ``torch.fx.GraphModule``, one per stage, to pass to
    :class:`Pipeline` as they are) and how they were cut.

    ``nodes``: the graph's compute nodes in topological order (names); ``starts[k]``: the
    index in ``nodes`` of stage ``k``'s first node; ``costs``: each node's cost under
    ``balance`` (seconds of forward+backward, or parameter bytes); ``stage_costs``: their
    sums per stage; ``sent[k]``: the names of the values stage ``k`` hands to stage ``k+1``
    (packed into one tensor when more than one); ``boundary_bytes[k]``: their bytes on the
    example batch; ``cuttable``: the indices where a stage may start (for ``cuts``).
    The stages hold ``model``'s own parameters and buffers (not copies)."""

    nodes: list
    starts: list
    costs: list
    stage_costs: list
    sent: list
    boundary_bytes: list
    cuttable: list
    balance: str

    def stage_nodes(self, k: int) -> list:
        """The names of stage ``k``'s nodes."""
        end = self.starts[k + 1] if k + 1 < len(self.starts) else len(self.nodes)
        return self.nodes[self.starts[k]:end]

    def describe(self) -> str:
        """One line per stage: nodes, cost, values sent on."""
        lines = []
        for k in range(len(self)):
            names = self.stage_nodes(k)
            sent = (f" -> {self.sent[k]} ({self.boundary_bytes[k]} B)"
                    if k < len(self.sent) else "")
            lines.append(f"stage {k}: {names[0]}..{names[-1]} ({len(names)} nodes), "
                         f"{self.balance} {self.stage_costs[k]:.6g}{sent}")
        return "\n".join(lines)


def partition(model: torch.nn.Module, num_stages: int, example_inputs: Any,
              balance: str = "time", group: Any = None, cuts: Sequence[Any] | None = None,
              repeats: int = 3) -> Partition:
    """Cut ``model`` into ``num_stages`` contiguous pipeline stages.

    Collective over the world under ``balance="time"``: every rank passes the same model
    and example and gets the same cut (the times are averaged over the world, so pipeline
    replicas along a data-parallel axis cut alike; ``"params"`` needs no communication).
    ``group`` (default: the world) is the pipeline group that will run the stages, which
    fixes their count. The model is traced (``nn.Sequential`` by its children, else
    ``torch.fx.symbolic_trace``); each compute node is measured on ``example_inputs`` (one
    tensor, or a tuple holding one; batch first, at least 2 rows; any dtype): forward +
    backward seconds (the median of ``repeats``, taken round-robin over the nodes), the
    bytes of the parameters it reads and of its output. A dynamic program over the
    topological order picks the cut whose slowest stage is fastest (``balance="time"``) or
    whose largest stage holds the fewest parameter bytes (``"params"``), and among those
    the one sending the fewest bytes between stages. ``cuts`` (optional) gives the cut
    instead: the index (into :attr:`Partition.nodes`) or name of the first node of each
    stage after the first.

    Stage 0 takes the model's input; the last stage returns the model's output (one
    tensor). In between, a stage returns the one tensor the next needs, or, when several
    values are needed later (skip connections, the input, a weight tied between the first
    and last layers), one flat tensor of their common dtype that the next stage unpacks
    (its length: ``rows * per-sample size`` of the batch-first values plus the size of the
    fixed-shape ones). Gradients flow through the packing, so a travelling weight's
    gradient reaches the stage holding it. Buffers go with every stage that reads them
    (each holds the same tensor), frozen parameters with the stage that reads them first
    (later readers get them as values). A parameter tied between modules other than
    ``nn.Linear``/``nn.Embedding`` keeps its readers in one stage. The stages hold
    ``model``'s own parameters and buffers, not copies.

    ``num_stages`` must be a multiple of the group's size (equal under ``gpipe``, ``1f1b``
    and ``chimera``; ``chunks`` times under ``interleaved``).

    Raises ``TypeError`` naming the module fx cannot trace; ``ValueError`` for more stages
    than compute nodes, a ``num_stages`` the group cannot run, or no possible cut (naming
    the node or parameter that blocks each place)."""
    rank = _rank(group)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"{where('pipeline.partition', rank)}: argument 'num_stages'="
                         f"{num_stages!r} must be a positive int")
    if balance not in BALANCES:
        raise ValueError(f"{where('pipeline.partition', rank)}: argument 'balance'="
                         f"{balance!r} must be one of {BALANCES}")
    grp = group if group is not None else primitives.world()
    if num_stages % grp.size:
        raise ValueError(f"{where('pipeline.partition', rank)}: argument 'num_stages'="
                         f"{num_stages} must be a multiple of the group's {grp.size} ranks "
                         f"(one stage per rank; 'chunks' per rank under 'interleaved')")
    example = _example(example_inputs, rank)
    gm = trace(model, where('pipeline.partition', rank))
    infos = profile(gm, example, balance == "time", repeats)
    n = len(infos)
    if num_stages > n:
        raise ValueError(f"{where('pipeline.partition', rank)}: argument 'num_stages'="
                         f"{num_stages} exceeds the {n} compute nodes of "
                         f"{type(model).__name__} ({[i.node.name for i in infos]})")
    if balance == "time":
        costs = _agree([i.seconds for i in infos], primitives.world(), type(model).__name__)
    else:
        costs = [float(i.param_bytes) for i in infos]
    crossing, blocked, nbytes = _boundaries(gm, infos, example)
    if cuts is not None:
        starts = _given(cuts, infos, num_stages, blocked, rank)
    else:
        starts = _solve(costs, nbytes, blocked, num_stages, rank)
    out = _build(gm, infos, example, starts, crossing, nbytes, costs, balance)
    out.cuttable = [i + 1 for i, why in enumerate(blocked) if why is None]
    return out


def _rank(group: Any) -> int:
    from ..core.runtime import init
    init()
    return (group if group is not None else primitives.world()).rank


def _example(example_inputs: Any, rank: int) -> torch.Tensor:
    x = example_inputs
    if isinstance(x, (tuple, list)) and len(x) == 1:
        x = x[0]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where('pipeline.partition', rank)}: argument 'example_inputs' "
                        f"must be one tensor (or a tuple of one): the pipeline feeds its "
                        f"first stage one tensor; got {type(example_inputs).__name__}")
    if x.dim() == 0 or x.shape[0] < 2:
        raise ValueError(f"{where('pipeline.partition', rank)}: argument 'example_inputs' "
                         f"of shape {tuple(x.shape)} must have a batch dimension first of at "
                         f"least 2 rows (to tell batch dimensions from fixed ones)")
    return x


def _agree(seconds: list, group: Any, model: str) -> list:
    """The mean over the group of each node's seconds, the same floats on every rank."""
    count = torch.tensor([len(seconds), -len(seconds)], dtype=torch.int64)
    group.allreduce(count, op=ReduceOp.MAX)
    if int(count[0]) != -int(count[1]):
        raise ValueError(f"{where('pipeline.partition', group.rank)}: {model} has "
                         f"{len(seconds)} compute nodes here, but between {-int(count[1])} "
                         f"and {int(count[0])} on the ranks of the world: every rank must "
                         f"pass the same model")
    t = torch.tensor(seconds, dtype=torch.float64)
    group.allreduce(t)
    t /= group.size
    group.broadcast(t, src=0)   # one rounding for all
    return t.tolist()


def _boundaries(gm: fx.GraphModule, infos: list, example: torch.Tensor) -> tuple:
    """For each place ``i`` (between nodes ``i`` and ``i+1``): the values crossing it (in
    order of definition), why it cannot be cut (None where it can), their bytes."""
    n = len(infos)
    pos = {info.node: i for i, info in enumerate(infos)}
    place = next(x for x in gm.graph.nodes if x.op == "placeholder")
    pos[place] = -1
    value = {info.node: info for info in infos}
    last: dict = {}
    for node in pos:
        uses = [pos.get(u, n) for u in node.users]   # the output node: n
        last[node] = max(uses, default=-1)
    first_read: dict = {}
    last_read: dict = {}
    for i, info in enumerate(infos):
        for key, (name, _) in info.params.items():
            first_read.setdefault(key, (i, name))
            last_read[key] = (i, name)
    crossing, blocked, nbytes = [], [], []
    for i in range(n - 1):
        vals = [v for v in pos if pos[v] <= i < last[v]]
        vals.sort(key=pos.get)
        crossing.append(vals)
        nbytes.append(sum(_bytes_of(v, value, example) for v in vals))
        blocked.append(_why_not(i, vals, value, example, infos, first_read, last_read))
    return crossing, blocked, nbytes


def _bytes_of(v: fx.Node, value: dict, example: torch.Tensor) -> int:
    if v in value:
        return value[v].out_bytes
    return example.numel() * example.element_size()


def _why_not(i: int, vals: list, value: dict, example: torch.Tensor, infos: list,
             first_read: dict, last_read: dict) -> str | None:
    after = f"after node {infos[i].node.name!r}"
    for key, (j, name) in first_read.items():
        if j <= i < last_read[key][0]:
            return (f"{after}: parameter {name!r} is read by nodes {infos[j].node.name!r} "
                    f"and {infos[last_read[key][0]].node.name!r} (a tie that cannot travel)")
    if not vals:
        return f"{after}: no value is used later (a stage would receive nothing)"
    kinds = []
    for v in vals:
        info = value.get(v)
        t, batched = (info.value, info.batched) if info else (example, True)
        if not isinstance(t, torch.Tensor):
            return (f"{after}: node {v.name!r} ({type(t).__name__}, not a tensor) is used "
                    f"later")
        kinds.append((v, t, batched))
    if len(kinds) > 1:
        dtypes = {t.dtype for _, t, _ in kinds}
        if len(dtypes) > 1:
            return (f"{after}: values of different dtypes are used later ("
                    f"{', '.join(f'{v.name!r}: {t.dtype}' for v, t, _ in kinds)})")
        for v, t, batched in kinds:
            if batched is None:
                return (f"{after}: node {v.name!r} of shape {tuple(t.shape)} is used later "
                        f"with other values, and its shape is neither batch-first nor fixed")
    return None


def _solve(costs: list, nbytes: list, blocked: list, stages: int, rank: int) -> list:
    """Stage start indices minimising the largest stage cost, then the bytes sent."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    ok = [j == 0 or blocked[j - 1] is None for j in range(n)]   # a stage may start at j
    # phase 1: the smallest bottleneck over the first j nodes in k stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    for j in range(1, n + 1):
        best[1][j] = prefix[j]
    for k in range(2, stages + 1):
        for j in range(k, n + 1):
            b = inf
            for i in range(k - 1, j):
                if ok[i] and best[k - 1][i] < inf:
                    b = min(b, max(best[k - 1][i], prefix[j] - prefix[i]))
            best[k][j] = b
    limit = best[stages][n]
    if limit == inf:
        reasons = [r for r in blocked if r is not None]
        raise ValueError(f"{where('pipeline.partition', rank)}: no cut into {stages} stages: "
                         f"{len(reasons)} of the {n - 1} places between nodes cannot be cut: "
                         + "; ".join(reasons[:8]) + ("; ..." if len(reasons) > 8 else ""))
    # phase 2: the fewest bytes sent among cuts whose every stage costs at most the limit
    sent = [[inf] * (n + 1) for _ in range(stages + 1)]
    back = [[-1] * (n + 1) for _ in range(stages + 1)]
    for j in range(1, n + 1):
        if prefix[j] - prefix[0] <= limit:
            sent[1][j] = 0
    for k in range(2, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                if ok[i] and sent[k - 1][i] < inf and prefix[j] - prefix[i] <= limit:
                    v = sent[k - 1][i] + nbytes[i - 1]
                    if v < sent[k][j]:
                        sent[k][j], back[k][j] = v, i
    starts, j = [], n
    for k in range(stages, 1, -1):
        j = back[k][j]
        starts.append(j)
    return [0] + starts[::-1]


def _given(cuts: Sequence[Any], infos: list, stages: int, blocked: list, rank: int) -> list:
    names = [i.node.name for i in infos]
    starts = [0]
    for c in cuts:
        if isinstance(c, str):
            if c not in names:
                raise ValueError(f"{where('pipeline.partition', rank)}: argument 'cuts' "
                                 f"names node {c!r}, which is not one of {names}")
            c = names.index(c)
        if isinstance(c, bool) or not isinstance(c, int) or not starts[-1] < c < len(names):
            raise ValueError(f"{where('pipeline.partition', rank)}: argument 'cuts' must be "
                             f"increasing node indices in 1..{len(names) - 1} (or names); "
                             f"got {list(cuts)}")
        if blocked[c - 1] is not None:
            raise ValueError(f"{where('pipeline.partition', rank)}: argument 'cuts' cannot "
                             f"cut {blocked[c - 1]}")
        starts.append(c)
    if len(starts) != stages:
        raise ValueError(f"{where('pipeline.partition', rank)}: argument 'cuts' gives "
                         f"{len(starts)} stages; num_stages={stages}")
    return starts


def _spec(vals: list, value: dict) -> tuple:
    spec = []
    for v in vals:
        info = value.get(v)
        if info is None or info.batched:   # the input, or batch-first
            shape = tuple(info.value.shape[1:]) if info is not None else None
            spec.append((shape, True))
        else:
            spec.append((tuple(info.value.shape), False))
    return tuple(spec)


def _build(gm: fx.GraphModule, infos: list, example: torch.Tensor, starts: list,
           crossing: list, nbytes: list, costs: list, balance: str) -> Partition:
    n = len(infos)
    value = {info.node: info for info in infos}
    place = next(x for x in gm.graph.nodes if x.op == "placeholder")
    result = next(x for x in gm.graph.nodes if x.op == "output").args[0]
    ends = starts[1:] + [n]
    out = Partition()
    for k, (a, b) in enumerate(zip(starts, ends)):
        graph = fx.Graph()
        x = graph.placeholder("x")
        env: dict = {}
        received = [place] if k == 0 else crossing[a - 1]
        if len(received) == 1:
            env[received[0]] = x
        else:
            spec = _spec(received, value)
            spec = tuple((s if s is not None else tuple(example.shape[1:]), bt)
                         for s, bt in spec)
            parts = graph.call_function(_unpack, (x, spec))
            for i, v in enumerate(received):
                env[v] = graph.call_function(operator.getitem, (parts, i))
        for info in infos[a:b]:
            env[info.node] = graph.node_copy(info.node, lambda v: env[v])
        sent = [result] if k == len(starts) - 1 else crossing[b - 1]
        if len(sent) == 1:
            graph.output(env[sent[0]])
        else:
            graph.output(graph.call_function(_pack, ([env[v] for v in sent],)))
        graph.lint()
        out.append(fx.GraphModule(gm, graph, f"Stage{k}"))
    out.nodes = [i.node.name for i in infos]
    out.starts = list(starts)
    out.costs = list(costs)
    out.stage_costs = [sum(costs[a:b]) for a, b in zip(starts, ends)]
    out.sent = [[v.name for v in crossing[b - 1]] for b in ends[:-1]]
    out.boundary_bytes = [nbytes[b - 1] for b in ends[:-1]]
    out.balance = balance
    return out
