"""Differential suite: Pipeline against one process, float64, after every step.

Each rank builds the whole model from the case's seed and computes, alone, what one process
gives for the same data: gradient accumulation over the micro-batches (averaged over the
data-parallel replicas' batches), the same optimizer, the same evaluations. Its pipeline
stages must match that reference after every step: loss, gradients (``None`` exactly where
one process has ``None``), parameters, buffers, eval outputs. Cases are generated (seeded):
every schedule and layout ``pp x dp`` the world size allows, 1-5 micro-batches, stages with
frozen and unused parameters, tied weights, float32 or complex128 parameters beside float64
ones, BatchNorm buffers, accumulation over steps without ``zero_grad``, eval between steps,
SGD and AdamW with weight decay. Negative controls (a Chimera pipeline that skips the
replica allreduce, the old exchange that gave frozen parameters zero gradients, a
data-parallel axis left unaveraged) must be rejected by the same checks.
"""
import copy
import dataclasses
import os

import numpy as np
import pytest
import torch

import commlib
import commlib.pipeline.executor as executor

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("one_thread_per_rank")]

# generated cases per layout pp x dp at each world size (fewer where a case costs more)
CASES = {1: 60, 2: 40, 3: 30, 4: 25}
SCALE = float(os.environ.get("DIFF_CASES_SCALE", "1"))  # more cases for a soak run
lossf = torch.nn.functional.mse_loss


@dataclasses.dataclass
class Case:
    seed: int
    pp: int
    dp: int
    schedule: str
    chunks: int
    micro: int
    batch: int
    widths: list
    features: list      # one dict per stage
    steps: list         # (zero_grad, eval_after) per step
    optimizer: str
    dp_group: bool      # pass the dp group even when dp == 1
    broadcast: bool     # Pipeline's broadcast_weights (the weights agree anyway)

    @property
    def mixed32(self):
        return any(f["mixed"] == "float32" for f in self.features)

    def __str__(self):
        return (f"case seed={self.seed} pp={self.pp} dp={self.dp} {self.schedule}"
                f"{f'(chunks={self.chunks})' if self.schedule == 'interleaved' else ''} "
                f"M={self.micro} B={self.batch} widths={self.widths} opt={self.optimizer} "
                f"steps={self.steps} features={self.features}")


def generate(seed, pp, dp, schedule=None, force=None):
    rng = np.random.default_rng(seed)
    schedules = ["gpipe", "1f1b", "interleaved"] + (["chimera"] if pp % 2 == 0 else [])
    schedule = schedule or str(rng.choice(schedules))
    chunks = int(rng.integers(1, 4)) if schedule == "interleaved" else 1
    micro = int(rng.integers(2 if schedule == "chimera" else 1, 6))
    count = pp * chunks
    bn_ok = schedule != "chimera"  # Chimera's replicas see different micro-batches
    features = []
    for _ in range(count):
        f = {"frozen_weight": rng.random() < 0.15, "frozen_bias": rng.random() < 0.3,
             "unused": rng.random() < 0.3, "tied": rng.random() < 0.25,
             "mixed": str(rng.choice(["none", "none", "float32", "complex128"])),
             "bn": bn_ok and rng.random() < 0.25}
        if force:
            f.update(force)
        features.append(f)
    batch = micro * (2 if any(f["bn"] for f in features) else 1) + int(rng.integers(0, 4))
    steps = [(bool(rng.random() < 0.7), bool(rng.random() < 0.3))
             for _ in range(int(rng.integers(2, 4)))]
    return Case(seed, pp, dp, schedule, chunks, micro, batch,
                [int(w) for w in rng.integers(2, 6, size=count + 1)], features, steps,
                str(rng.choice(["sgd", "adamw"])), bool(rng.random() < 0.5),
                bool(rng.random() < 0.25))


class Stage(torch.nn.Module):
    def __init__(self, win, wout, f):
        super().__init__()
        self.f = f
        self.lin = torch.nn.Linear(win, wout).double()
        self.lin.weight.requires_grad_(not f["frozen_weight"])
        self.lin.bias.requires_grad_(not f["frozen_bias"])
        if f["unused"]:
            self.unused = torch.nn.Parameter(torch.randn(2, dtype=torch.float64))
        if f["tied"]:  # two layers, one weight
            self.a = torch.nn.Linear(wout, wout).double()
            self.b = torch.nn.Linear(wout, wout).double()
            self.b.weight = self.a.weight
        if f["bn"]:
            self.bn = torch.nn.BatchNorm1d(wout).double()
        if f["mixed"] == "float32":
            self.scale = torch.nn.Parameter(torch.rand(wout) + 0.5)
        if f["mixed"] == "complex128":
            self.phase = torch.nn.Parameter(torch.randn(wout, dtype=torch.complex128))

    def forward(self, x):
        y = self.lin(x)
        if self.f["tied"]:
            y = y + 0.5 * self.b(torch.tanh(self.a(y)))
        if self.f["bn"]:
            y = self.bn(y)
        y = torch.tanh(y)
        if self.f["mixed"] == "float32":
            y = y * self.scale.double()
        if self.f["mixed"] == "complex128":
            y = (y * (1 + 0.3 * self.phase)).real
        return y


def build(case):
    torch.default_generator.manual_seed(case.seed)  # (torch.manual_seed seeds every device: slow)
    return [Stage(case.widths[i], case.widths[i + 1], f) for i, f in enumerate(case.features)]


def data(case, d, step, rows=None):
    g = torch.Generator().manual_seed(case.seed * 1000 + 10 * step + d)
    rows = rows or case.batch
    return (torch.randn(rows, case.widths[0], generator=g, dtype=torch.float64),
            torch.randn(rows, case.widths[-1], generator=g, dtype=torch.float64))


def optimizer(case, params):
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)
    # eps=1e-3: the first steps divide by |grad| + eps, ill-conditioned for grads near
    # a tiny eps, where the order of the sums (which differs by design) would show
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, eps=1e-3)


def close(a, b, case):
    # float64: rounding differs only in the order of the sums (replicas, micro-batches);
    # AdamW and BatchNorm amplify it a little, a broken exchange gives 1e-3 or more
    tol = (1e-4, 1e-5) if case.mixed32 else (1e-9, 1e-10)
    return torch.allclose(a.detach().to(b.dtype), b.detach(), rtol=tol[0], atol=tol[1])


def compare(what, mine, ref, case, problems):
    """Parameters/grads/buffers of this rank's stages against the reference stages."""
    for name, t in mine:
        r = ref[name]
        if (t is None) != (r is None):
            problems.append(f"{what} {name}: {'None' if t is None else 'a tensor'}, one "
                            f"process has {'None' if r is None else 'a tensor'}")
        elif t is not None and not close(t, r, case):
            problems.append(f"{what} {name}: differs by "
                            f"{(t.detach().to(r.dtype) - r.detach()).abs().max().item():.3g}")


def state(stages, ids, kind):
    """(name, tensor) of stages ``ids``: 'grad', 'param' or 'buffer'."""
    out = []
    for s in ids:
        if kind == "buffer":
            out += [(f"stage {s} buffer {n}", b) for n, b in stages[s].named_buffers()]
        else:
            out += [(f"stage {s} {kind} {n}", p.grad if kind == "grad" else p)
                    for n, p in stages[s].named_parameters()]
    return out


def run_case(case, topo, tamper=None):
    """Run ``case`` on this rank's pipeline and reference; return this rank's problems."""
    stages = build(case)
    refs = [copy.deepcopy(stages) for _ in range(case.dp)]  # one per data-parallel replica
    me = topo.coord.dp
    dp_group = topo.group("dp") if case.dp > 1 or case.dp_group else None
    pipe = executor.Pipeline(stages, group=topo.group("pp"), schedule=case.schedule,
                             micro_batches=case.micro, loss_fn=lossf, chunks=case.chunks,
                             dp_group=dp_group, broadcast_weights=case.broadcast)
    if tamper is not None:
        tamper(pipe)
    opt = optimizer(case, pipe.parameters())
    ref_opts = [optimizer(case, [p for s in r for p in s.parameters()]) for r in refs]
    problems = []
    for step, (zero, eval_after) in enumerate(case.steps):
        if zero:
            opt.zero_grad()
            for o in ref_opts:
                o.zero_grad()
        x, y = data(case, me, step)
        loss = pipe.train_step(x, y)
        ref_loss = None
        for d, ref in enumerate(refs):
            model = torch.nn.Sequential(*ref)
            total = 0.0
            xd, yd = data(case, d, step)
            for xm, ym in zip(torch.tensor_split(xd, case.micro),
                              torch.tensor_split(yd, case.micro)):
                lm = lossf(model(xm), ym)
                total += lm.item()
                if lm.requires_grad:  # (every parameter frozen: nothing to do, as the pipeline)
                    (lm / case.micro).backward()
            if d == me:
                ref_loss = total / case.micro
        if case.dp > 1:  # the average of the replicas' gradients, on every replica
            per = [[p for s in r for p in s.parameters()] for r in refs]
            for ps in zip(*per):
                if ps[0].grad is not None:
                    avg = sum(p.grad for p in ps) / case.dp
                    for p in ps:
                        p.grad = avg.clone()
        mine = refs[me]
        if abs(loss - ref_loss) > 1e-9 * max(1.0, abs(ref_loss)) and not case.mixed32:
            problems.append(f"step {step}: loss {loss} != {ref_loss}")
        compare(f"step {step} grad", state(stages, pipe.local_ids, "grad"),
                dict(state(mine, pipe.local_ids, "grad")), case, problems)
        opt.step()
        for o in ref_opts:
            o.step()
        compare(f"step {step}", state(stages, pipe.local_ids, "param"),
                dict(state(mine, pipe.local_ids, "param")), case, problems)
        compare(f"step {step}", state(stages, pipe.local_ids, "buffer"),
                dict(state(mine, pipe.local_ids, "buffer")), case, problems)
        if eval_after:
            pipe.eval()
            xe, _ = data(case, 7, step, rows=case.micro + 1)
            out = pipe.eval_step(xe)
            model = torch.nn.Sequential(*mine).eval()
            with torch.no_grad():
                want = torch.cat([model(xm) for xm in torch.tensor_split(xe, case.micro)])
            if not close(out, want, case):
                problems.append(f"step {step}: eval output differs by "
                                f"{(out - want).abs().max().item():.3g}")
            pipe.train()
            model.train()
        if problems:
            break
    pipe.close()
    return problems


def rejected(problems):
    """Whether any rank found a problem (agreed on every rank)."""
    return bool(commlib.allreduce(np.array([len(problems)]))[0])


@pytest.fixture(scope="module")
def layouts():
    """Topology(dp, pp) for every factorisation pp x dp of the world size."""
    n = commlib.get_world_size()
    topos = {(pp, n // pp): commlib.Topology(dp=n // pp, pp=pp)
             for pp in range(1, n + 1) if n % pp == 0}
    yield topos
    for t in topos.values():
        t.free()


def test_pipeline_matches_one_process(layouts):
    n = commlib.get_world_size()
    counts = {}
    for (pp, dp), topo in sorted(layouts.items()):
        for i in range(int(CASES.get(n, 20) * SCALE)):
            case = generate(1000 * n + 100 * pp + i, pp, dp)
            problems = run_case(case, topo)
            if rejected(problems):
                raise AssertionError(f"rank {commlib.get_rank()}: {case}: "
                                     f"{problems[:4] or 'failed on another rank'}")
            counts[case.schedule] = counts.get(case.schedule, 0) + 1
    print(f"\n{sum(counts.values())} pipeline cases at {n} ranks: {counts}")


def test_negative_controls(layouts, monkeypatch):
    """Tampered pipelines the checks must reject, every case."""
    n = commlib.get_world_size()
    controls = []
    for (pp, dp), topo in sorted(layouts.items()):
        frozen = {"frozen_bias": True, "unused": True}
        # the old exchange: zeros for every parameter without a gradient (frozen, unused)
        case = dataclasses.replace(generate(7 + pp, pp, dp, "1f1b", frozen), dp_group=True)
        controls.append(("old zero-filling exchange", topo, case, None, "old"))
        if pp % 2 == 0:
            def skip(pipe):
                pipe.actions = [a for a in pipe.actions if a.kind != "allreduce"]
            controls.append(("Chimera without the replica allreduce", topo,
                             generate(8 + pp, pp, dp, "chimera"), skip, None))
        if dp > 1:
            def no_dp(pipe):
                pipe.dp_group = None
            controls.append(("data-parallel axis not averaged", topo,
                             generate(9 + pp, pp, dp, "gpipe"), no_dp, None))

    def old_unpack(flat, params):  # what the executor did before issue 19
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def old_trainable(module):
        return list(module.parameters())

    for what, topo, case, tamper, patch in controls:
        if patch == "old":
            monkeypatch.setattr(executor, "_unpack", old_unpack)
            monkeypatch.setattr(executor, "_trainable", old_trainable)
        problems = run_case(case, topo, tamper)
        monkeypatch.undo()
        assert rejected(problems), f"negative control not rejected: {what}: {case}"
    print(f"\n{len(controls)} pipeline negative controls rejected at {n} ranks")
