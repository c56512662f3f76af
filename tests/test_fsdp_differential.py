"""Differential testing of commlib.FullyShardedDataParallel against torch's FSDP2
(``torch.distributed.fsdp.fully_shard``) over gloo, in the same mpiexec job.

A seeded generator draws small module trees (the same case on every rank): an input layer,
1-3 blocks (some holding a sub-block), a head; nesting (blocks and sub-blocks wrapped
first, inner to outer, then the root; sometimes the input layer alone), tied parameters
(head tied to the input layer), frozen parameters (a bias, the input layer, a whole block),
buffers (persistent and not; BatchNorm's running statistics), a float32 block among
float64 ones, a parameter used outside its module (the input layer's weight in the root's
forward), user forward pre- and post-hooks that read their module's parameters, a
weight-normed layer (parametrizations), gradient accumulation over 1-3 micro-batches
(``no_sync`` / ``set_requires_gradient_sync(False)``, or several synchronized backwards),
eval forwards between steps, SGD with momentum and weight decay, Adam, AdamW, chunks from
~26 elements to 4 MiB. Each case trains torch's model (``fully_shard`` on the same
modules: ``FULL_SHARD`` -> ``reshard_after_forward=True``, ``SHARD_GRAD_OP`` -> ``False``,
``NO_SHARD`` -> an HSDP mesh of N replicas of one shard) and commlib's from the same
weights on the same per-rank data, and requires on every rank, after every step, the same
losses, the same full (gathered) state dict (the unwrapped model's keys; 1e-10 in float64,
1e-5 in cases with a float32 block) and the same eval outputs. Before training, both state
dicts equal the unwrapped model's. Where torch raises (a parameter tied across two
wrappers; a released parameter used outside its wrapper's forward), commlib must raise
too, at the same point, on every rank. Where ``fully_shard`` refuses a float32 block
inside a float64 group (it wants one dtype per group), commlib trains it and is compared
with the unwrapped model trained in one process on every rank's data.

``CASES`` cases per strategy at each world size (16 at 1-3 ranks, 8 at 4: CI time;
``COMMLIB_FSDP_DIFF_CASES`` for more);
three broken variants of commlib (no gradient reduce-scatter, the neighbour's shard of
the averaged gradient, the first step's gradients dropped) must be rejected.
"""
from __future__ import annotations

import contextlib
import os
import random
import warnings
from dataclasses import dataclass, field

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import commlib  # noqa: E402
from torch_gloo import gloo_world  # noqa: E402


def _default_cases() -> int:
    import sys
    mpi = sys.modules.get("mpi4py.MPI")
    return 16 if mpi is None or mpi.COMM_WORLD.Get_size() <= 3 else 8


CASES = int(os.environ.get("COMMLIB_FSDP_DIFF_CASES", _default_cases()))
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
pytestmark = pytest.mark.differential


@dataclass
class BlockSpec:
    bn: bool = False
    wn: bool = False
    f32: bool = False
    sub: BlockSpec | None = None


@dataclass
class Case:
    index: int
    strategy: str
    d: int
    d_out: int
    blocks: list
    wrapped: list          # module paths wrapped before the root, inner first
    tie: bool
    frozen: str            # none, bias, emb, block
    reuse: bool            # the root's forward uses emb.weight
    hooks: bool
    accumulate: int
    no_sync: bool
    eval_between: bool
    optimizer: str
    chunk_mb: float
    steps: int = 3
    f32: bool = field(init=False)

    def __post_init__(self):
        self.f32 = any(b.f32 for b in self.blocks)

    def __str__(self):
        return (f"case {self.index} ({self.strategy}; blocks {self.blocks}; wrapped "
                f"{self.wrapped}; tie={self.tie} frozen={self.frozen} reuse={self.reuse} "
                f"hooks={self.hooks} accumulate={self.accumulate} no_sync={self.no_sync} "
                f"eval={self.eval_between} {self.optimizer} chunk {self.chunk_mb} MiB)")


def draw(index: int, strategy: str) -> Case:
    rng = random.Random(index * 7 + STRATEGIES.index(strategy))
    specs, wrapped = [], []
    for i in range(rng.randint(1, 3)):
        sub = BlockSpec(wn=rng.random() < 0.2) if rng.random() < 0.3 else None
        spec = BlockSpec(bn=rng.random() < 0.25, wn=rng.random() < 0.2,
                         f32=rng.random() < 0.15, sub=sub)
        specs.append(spec)
        if sub is not None and rng.random() < 0.5:
            wrapped.append(f"blocks.{i}.sub")
        if rng.random() < 0.5:
            wrapped.append(f"blocks.{i}")
    if rng.random() < 0.12:
        wrapped.append("emb")
    # a float32 block in a float64 wrapper's scope: trained against one process, where
    # batch-norm statistics (per rank) are not comparable
    if any(s.f32 and f"blocks.{i}" not in wrapped for i, s in enumerate(specs)):
        for s in specs:
            s.bn = False
    d = rng.randint(3, 6)
    tie = rng.random() < 0.25
    return Case(index=index, strategy=strategy, d=d, d_out=d if tie else rng.randint(2, 3),
                blocks=specs, wrapped=wrapped, tie=tie,
                frozen=rng.choice(["none", "none", "bias", "emb", "block"]),
                reuse=rng.random() < 0.4, hooks=rng.random() < 0.3,
                accumulate=rng.choice([1, 1, 2, 3]), no_sync=rng.random() < 0.6,
                eval_between=rng.random() < 0.3,
                optimizer=rng.choice(["sgd", "adam", "adamw"]),
                chunk_mb=rng.choice([0.0002, 0.001, 4.0]))


class Block(nn.Module):
    def __init__(self, d: int, spec: BlockSpec):
        super().__init__()
        self.fc = nn.Linear(d, d)
        if spec.wn:
            nn.utils.parametrizations.weight_norm(self.fc)
        self.bn = nn.BatchNorm1d(d) if spec.bn else None
        self.sub = Block(d, spec.sub) if spec.sub is not None else None
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))
        self.register_buffer("shift", torch.full((d,), 0.01), persistent=False)

    def forward(self, x):
        h = x.to(self.scale.dtype)
        h = torch.tanh(self.fc(h)) * self.scale + self.shift
        if self.bn is not None:
            h = self.bn(h)
        if self.sub is not None:
            h = h + self.sub(h).to(h.dtype)
        return h.double()


class Root(nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        self.case = case
        self.emb = nn.Linear(case.d, case.d)
        self.blocks = nn.ModuleList(Block(case.d, s) for s in case.blocks)
        self.head = nn.Linear(case.d, case.d_out)

    def forward(self, x):
        h = torch.tanh(self.emb(x))
        for block in self.blocks:
            h = block(h)
        out = self.head(h)
        if self.case.reuse:   # a parameter used outside its module
            out = out + 0.1 * (h @ self.emb.weight.t())[:, :self.case.d_out]
        return out


def build(case: Case) -> nn.Module:
    torch.manual_seed(case.index)
    model = Root(case).double()
    for i, spec in enumerate(case.blocks):
        if spec.f32:
            model.blocks[i].float()
    if case.tie:
        model.head.weight = model.emb.weight
    if case.frozen == "bias":
        model.blocks[0].fc.bias.requires_grad_(False)
    elif case.frozen == "emb":
        model.emb.requires_grad_(False)
    elif case.frozen == "block":
        model.blocks[-1].requires_grad_(False)
    if case.hooks:   # registered before wrapping, read the module's own parameters
        b = model.blocks[0]
        b.register_forward_pre_hook(lambda m, args: (args[0] * (1 + 0.1 * m.scale.mean()
                                                                * m.fc.bias.mean()),))
        b.register_forward_hook(lambda m, args, out: out * (1 + 0.1 * m.fc.bias.sum()))
    return model


def _get(model: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        model = getattr(model, part)
    return model


def _set(model: nn.Module, path: str, value: nn.Module) -> None:
    head, _, last = path.rpartition(".")
    parent = _get(model, head) if head else model
    if isinstance(parent, nn.ModuleList):
        parent[int(last)] = value
    else:
        setattr(parent, last, value)


_MESHES: dict = {}


def meshes():
    """(flat mesh over the gloo world, HSDP mesh of N replicas x 1 shard)."""
    if not _MESHES:
        from torch.distributed.device_mesh import DeviceMesh
        group = gloo_world()
        if dist.get_backend(group) != "gloo":
            group = dist.new_group(backend="gloo")
        n, rank = dist.get_world_size(), dist.get_rank()
        singles = [dist.new_group([r], backend="gloo") for r in range(n)]
        _MESHES["flat"] = DeviceMesh.from_group(group, "cpu")
        _MESHES["hsdp"] = DeviceMesh.from_group(
            [group, singles[rank]], "cpu", mesh=torch.arange(n).view(n, 1),
            mesh_dim_names=("replicate", "shard"))
    return _MESHES["flat"], _MESHES["hsdp"]


def torch_fsdp(case: Case) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    flat, hsdp = meshes()
    mesh = hsdp if case.strategy == "NO_SHARD" else flat
    kw = {"mesh": mesh, "reshard_after_forward": case.strategy == "FULL_SHARD"}
    model = build(case)
    for path in case.wrapped:
        fully_shard(_get(model, path), **kw)
    fully_shard(model, **kw)
    return model


def commlib_fsdp(case: Case, broken: str | None = None) -> nn.Module:
    FSDP = commlib.FullyShardedDataParallel
    kw = {"sharding_strategy": case.strategy, "chunk_size_mb": case.chunk_mb}
    model = build(case)
    try:
        for path in case.wrapped:
            _set(model, path, FSDP(_get(model, path), **kw))
        root = FSDP(model, **kw)
    except BaseException:
        for path in case.wrapped:
            m = _get(model, path)
            if isinstance(m, FSDP):
                m.close()
        raise
    if broken is not None:
        for w in root._wrappers():
            _break(w, broken)
    return root


def _break(w, broken: str) -> None:
    """Negative controls: a commlib wrapper that skips the gradient reduce-scatter, takes
    the neighbour's shard of the averaged gradient, or drops its first step's gradients."""
    if broken == "no_reduce":
        w._exchange = lambda c, grad: (grad.view(c.shards, -1)[c.rank].clone()
                                       if c.shards > 1 else grad)
    elif broken == "wrong_shard":
        def exchange(c, grad):
            grad = commlib.allreduce(grad.clone(), commlib.ReduceOp.AVG, w._reduce_group)
            return (grad.view(c.shards, -1)[(c.rank + 1) % c.shards].clone()
                    if c.shards > 1 else grad)
        w._exchange = exchange
    elif broken == "drops_step":
        original, dropped = w._end_backward, []

        def end():
            if not dropped:
                dropped.append(True)
                pending, w._pending = w._pending, []
                for _, future in pending:
                    future.result()
            original()
        w._end_backward = end


def optimizer(case: Case, model: nn.Module):
    params = list(model.parameters())
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    if case.optimizer == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.05)


def batch(case: Case, step: int, micro: int, rank: int):
    g = torch.Generator().manual_seed(case.index * 7919 + step * 31 + micro * 7 + rank)
    n = 2 + (rank + step) % 3   # ranks hold different batch sizes
    return (torch.randn(n, case.d, generator=g, dtype=torch.float64),
            torch.randint(0, case.d_out, (n,), generator=g))


def full_state(model: nn.Module) -> dict:
    """The full state dict (DTensors gathered: collective), detached copies."""
    out = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().clone()
    return out


def no_sync(model: nn.Module, ours: bool):
    if ours:
        return model.no_sync()

    @contextlib.contextmanager
    def off():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    return off()


def run(case: Case, make, ours: bool):
    """Build with ``make`` and train; (snapshots, (stage, exception) or None, model).
    A snapshot per step: (losses of this rank's micro-batches, full state, eval output)."""
    rank = commlib.get_rank()
    try:
        model = make(case)
    except (ValueError, RuntimeError, AssertionError) as exc:
        return [], ("construct", exc), None
    snapshots = []
    try:
        opt = optimizer(case, model)
        snapshots.append(([], full_state(model), None))
        for step in range(case.steps):
            opt.zero_grad()
            losses = []
            for micro in range(case.accumulate):
                last = micro == case.accumulate - 1
                ctx = contextlib.nullcontext() if last or not case.no_sync else \
                    no_sync(model, ours)
                with ctx:
                    x, y = batch(case, step, micro, rank)
                    loss = F.cross_entropy(model(x), y) / case.accumulate
                    loss.backward()
                    losses.append(float(loss))
            opt.step()
            out = None
            if case.eval_between:
                model.eval()
                with torch.no_grad():
                    out = model(batch(case, step, 9, rank)[0]).detach().clone()
                model.train()
            snapshots.append((losses, full_state(model), out))
    except (ValueError, RuntimeError, AssertionError) as exc:
        return snapshots, (f"step {len(snapshots) - 1}", exc), model
    return snapshots, None, model


def run_reference(case: Case):
    """The unwrapped model in one process on every rank's data (gradients averaged over
    ranks as FSDP averages them); the snapshots of this rank."""
    rank, n = commlib.get_rank(), commlib.get_world_size()
    model = build(case)
    opt = optimizer(case, model)
    snapshots = [([], full_state(model), None)]
    for step in range(case.steps):
        opt.zero_grad()
        losses = []
        for micro in range(case.accumulate):
            total = 0.0
            for r in range(n):
                x, y = batch(case, step, micro, r)
                loss = F.cross_entropy(model(x), y) / case.accumulate
                (loss / n).backward()
                if r == rank:
                    losses.append(float(loss))
        opt.step()
        out = None
        if case.eval_between:
            model.eval()
            with torch.no_grad():
                out = model(batch(case, step, 9, rank)[0]).detach().clone()
            model.train()
        snapshots.append((losses, full_state(model), out))
        del total
    return snapshots


def compare(case: Case, ours: list, theirs: list, expected_keys: list) -> str | None:
    """First difference between two runs on this rank, or None."""
    tol = 1e-5 if case.f32 else 1e-10
    for step, ((l1, s1, o1), (l2, s2, o2)) in enumerate(zip(ours, theirs)):
        where = f"{case}: after step {step - 1}" if step else f"{case}: before training"
        if list(s1) != expected_keys or list(s2) != expected_keys:
            return f"{where}: state dict keys {list(s1)} / {list(s2)}, expected {expected_keys}"
        for a, b in zip(l1, l2):
            if abs(a - b) > tol * max(1.0, abs(b)):
                return f"{where}: loss {a!r} != {b!r}"
        for k in expected_keys:
            a, b = s1[k], s2[k]
            if a.shape != b.shape or a.dtype != b.dtype:
                return f"{where}: {k} is {a.dtype}{tuple(a.shape)}, {b.dtype}{tuple(b.shape)}"
            if not torch.allclose(a.double(), b.double(), rtol=tol, atol=tol):
                return f"{where}: {k} differs by {float((a.double() - b.double()).abs().max())}"
        if (o1 is None) != (o2 is None) or (o1 is not None and not torch.allclose(
                o1, o2, rtol=tol, atol=tol)):
            return f"{where}: eval outputs differ"
    if len(ours) != len(theirs):
        return f"{case}: {len(ours)} snapshots, {len(theirs)} expected"
    return None


def agree(message: str | None) -> None:
    """Raise AssertionError on every rank if any rank found a difference (collective)."""
    flags = commlib.allgather(np.array([message is not None]))
    assert message is None and not flags.any(), message or (
        f"ranks {np.flatnonzero(flags).tolist()} found a difference")


def close(model) -> None:
    if isinstance(model, commlib.FullyShardedDataParallel):
        model.close()


_tally: dict = {}


@pytest.fixture(scope="module", autouse=True)
def report():
    warnings.filterwarnings("ignore", module="torch.distributed")
    yield
    if commlib.get_rank() == 0 and _tally:
        print(f"\nFSDP differential suite at {commlib.get_world_size()} ranks: "
              f"{sum(_tally.values())} cases; " +
              ", ".join(f"{k}: {v}" for k, v in sorted(_tally.items())))


def check_case(case: Case) -> str:
    """Run one case both ways; assert on every rank; return its tally key."""
    expected_keys = list(build(case).state_dict())
    theirs, torch_error, torch_model = run(case, torch_fsdp, ours=False)
    del torch_model
    ours, our_error, model = run(case, commlib_fsdp, ours=True)
    close(model)
    everyone = commlib.allgather(np.array([our_error is not None]))
    assert everyone.all() or not everyone.any(), f"{case}: commlib raised on some ranks only"
    refused_mixed = torch_error is not None and "uniform original parameter dtype" in str(
        torch_error[1])
    if refused_mixed:   # fully_shard wants one dtype per group: one process is the oracle
        assert our_error is None, f"{case}: commlib raised {our_error!r}"
        agree(compare(case, ours, run_reference(case), expected_keys))
        return "mixed dtypes vs one process"
    if torch_error is None or our_error is None:
        agree(None if (torch_error is None) == (our_error is None) else
              f"{case}: torch raised {torch_error!r}, commlib raised {our_error!r}")
    else:
        # the same kind of error at the same point; a refusal (ValueError: a parameter
        # tied across wrappers) may come at construction where torch's comes at its lazy
        # initialization, in the first forward
        refusal = isinstance(our_error[1], ValueError)
        same = refusal == isinstance(torch_error[1], ValueError) and (
            torch_error[0] == our_error[0] or (refusal and our_error[0] == "construct"))
        agree(None if same else f"{case}: torch raised {torch_error!r}, commlib raised "
                                f"{our_error!r}")
    agree(compare(case, ours, theirs if our_error is None else theirs[:len(ours)],
                  expected_keys))
    return "equal" if torch_error is None else f"both raised ({torch_error[0]})"


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_commlib_fsdp_matches_torch_fully_shard(strategy, one_thread_per_rank):
    for index in range(CASES):
        key = check_case(draw(index, strategy))
        _tally[f"{strategy} {key}"] = _tally.get(f"{strategy} {key}", 0) + 1


@pytest.mark.mpi
@pytest.mark.parametrize("broken", ["no_reduce", "wrong_shard", "drops_step"])
def test_negative_controls_are_rejected(broken, one_thread_per_rank):
    """The same comparison must reject each broken variant in every case torch trained."""
    if commlib.get_world_size() == 1 and broken != "drops_step":
        pytest.skip("one rank holds every shard: nothing to reduce")
    compared = rejected = 0
    for index in range(5):
        case = draw(index, ["FULL_SHARD", "SHARD_GRAD_OP"][index % 2])
        if case.frozen != "none":
            case.frozen = "bias"
        theirs, torch_error, _ = run(case, torch_fsdp, ours=False)
        ours, our_error, model = run(case, lambda c: commlib_fsdp(c, broken), ours=True)
        close(model)
        if torch_error is not None or our_error is not None:
            continue
        compared += 1
        message = compare(case, ours, theirs, list(build(case).state_dict()))
        flags = commlib.allgather(np.array([message is not None]))
        rejected += bool(flags.any())
    if commlib.get_rank() == 0:
        print(f"\nnegative control {broken}: {rejected} of {compared} compared cases "
              f"rejected")
    assert compared >= 4 and rejected == compared, (compared, rejected)
