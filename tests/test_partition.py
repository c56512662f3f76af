"""commlib.pipeline.partition: automatic stages for Pipeline.

Multi-rank (``mpi``): generated models (a residual MLP with a long skip, a ResNet-like CNN
with BatchNorm, a model with a buffer read at three places and frozen parameters, a
GPT-style stack whose head is tied to its token embedding) partitioned over the world run in
Pipeline under every schedule and equal one process in float64 after several optimizer
steps (losses, every parameter of this rank's stages, buffers, eval output); a partition
whose stage drops a skip connection is caught by the same check; balance="time" gives every
rank the same cut. Single process: the dynamic program against brute force enumeration, and
the errors (untraceable module, non-tensor across a cut, too many stages, a tie that
cannot travel, bad arguments).
"""
import copy
import itertools
import random

import numpy as np
import pytest
import torch

import commlib
from commlib.pipeline import partitioner
from partition_models import GPT, ResMLP, make

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")

SCHEDULES = ["gpipe", "1f1b", "interleaved", "chimera"]
MODELS = ["resmlp", "rescnn", "frozen", "gpt"]
MICRO = 4


def reference_step(model, opt, x, y, lossf, m):
    """One process: gradient accumulation over the m micro-batches, then the optimizer."""
    opt.zero_grad()
    total = 0.0
    for xm, ym in zip(torch.tensor_split(x, m), torch.tensor_split(y, m)):
        loss = lossf(model(xm), ym)
        total += loss.item()
        (loss / m).backward()
    opt.step()
    return total / m


def optimizer(name, params):
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def stage_error(pipe, ref, buffers=True):
    """Largest difference between this rank's stage parameters (and buffers) and the
    reference's (by name), and whether every frozen parameter kept ``.grad`` None."""
    err, frozen_ok = 0.0, True
    for s in pipe.local_ids:
        stage = pipe._all[s]
        for name, p in stage.named_parameters():
            q = ref.get_parameter(name)
            err = max(err, (p.detach() - q.detach()).abs().max().item())
            if not p.requires_grad:
                frozen_ok &= p.grad is None and q.grad is None
        for name, b in stage.named_buffers() if buffers else ():
            q = ref.get_buffer(name)
            if b.is_floating_point():
                err = max(err, (b - q).abs().max().item())
            else:
                err = max(err, float((b != q).any()))
    return err, frozen_ok


def run_case(name, schedule, opt_name="sgd", steps=3, sabotage=None, seed=0):
    """(largest loss difference, largest stage difference, frozen ok, eval difference or
    None) of a partitioned pipeline against one process."""
    n = commlib.get_world_size()
    model, x, y, lossf = make(name, seed)
    ref = copy.deepcopy(model)
    chunks = 2 if schedule == "interleaved" else 1
    stages = commlib.pipeline.partition(model, n * chunks, x, balance="params")
    if sabotage is not None:
        sabotage(stages)
    pipe = commlib.pipeline.Pipeline(stages, schedule=schedule, micro_batches=MICRO,
                                     loss_fn=lossf, chunks=chunks)
    opt = optimizer(opt_name, pipe.parameters())
    ref_opt = optimizer(opt_name, ref.parameters())
    loss_err = 0.0
    for _ in range(steps):
        opt.zero_grad()
        loss = pipe.train_step(x, y)
        opt.step()
        ref_loss = reference_step(ref, ref_opt, x, y, lossf, MICRO)
        loss_err = max(loss_err, abs(loss - ref_loss))
    # Chimera's replicas keep their own BatchNorm statistics (Pipeline's rule)
    err, frozen_ok = stage_error(pipe, ref, buffers=schedule != "chimera")
    eval_err = None
    if not (schedule == "chimera" and name == "rescnn"):
        # (Chimera's replicas keep their own BatchNorm statistics: eval differs there)
        with torch.no_grad():
            ref.eval()
            expect = ref(x)
        for stage in stages:
            stage.eval()
        eval_err = (pipe.eval_step(x) - expect).abs().max().item()
    pipe.close()
    return loss_err, err, frozen_ok, eval_err


def chimera_skip(schedule):
    if schedule == "chimera" and commlib.get_world_size() % 2:
        pytest.skip("chimera needs an even number of ranks")


@pytest.mark.mpi
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", MODELS)
def test_partitioned_pipeline_equals_one_process(name, schedule):
    chimera_skip(schedule)
    opt_name = "adamw" if name in ("frozen", "gpt") else "sgd"
    loss_err, err, frozen_ok, eval_err = run_case(name, schedule, opt_name)
    assert loss_err < 1e-10
    assert err < 1e-10, f"rank {commlib.get_rank()}: stage parameters differ by {err}"
    assert frozen_ok
    if eval_err is not None:
        assert eval_err < 1e-10


def drop_skip(stages):
    """Zero the first value a stage unpacks (a skip connection from an earlier stage)."""
    for stage in stages[1:]:
        unpack = [n for n in stage.graph.nodes if n.target is partitioner._unpack]
        if not unpack:
            continue
        first = next(u for u in unpack[0].users if u.args[1] == 0)
        with stage.graph.inserting_after(first):
            zero = stage.graph.call_function(torch.zeros_like, (first,))
        first.replace_all_uses_with(zero, delete_user_cb=lambda u: u is not zero)
        stage.recompile()
        return
    raise AssertionError("no stage receives more than one value")


@pytest.mark.mpi
def test_negative_control_dropped_skip_is_caught():
    n = commlib.get_world_size()
    if n < 2:
        pytest.skip("one stage has no skip across a cut")
    loss_err, err, _, eval_err = run_case("resmlp", "1f1b", sabotage=drop_skip, steps=2)
    assert loss_err > 1e-6 and eval_err > 1e-6   # the same on every rank
    errs = commlib.allgather(np.array([err]))[:, 0]
    assert errs.max() > 1e-6


@pytest.mark.mpi
def test_time_balance_same_cut_on_every_rank():
    n = commlib.get_world_size()
    model, x, y, lossf = make("gpt", 3)
    ref = copy.deepcopy(model)
    stages = commlib.pipeline.partition(model, n, x, balance="time", repeats=2)
    starts = commlib.allgather(np.array(stages.starts))
    costs = commlib.allgather(np.array(stages.costs))
    assert (starts == starts[0]).all() and (costs == costs[0]).all()
    assert all(c >= 0 for c in stages.costs) and sum(stages.costs) > 0
    pipe = commlib.pipeline.Pipeline(stages, schedule="1f1b", micro_batches=MICRO,
                                     loss_fn=lossf)
    loss = pipe.train_step(x, y)
    ref_loss = reference_step(ref, torch.optim.SGD(ref.parameters(), lr=0.0), x, y, lossf,
                              MICRO)
    assert abs(loss - ref_loss) < 1e-10
    pipe.close()


@pytest.mark.mpi
def test_stage_count_must_fit_the_group():
    n = commlib.get_world_size()
    if n < 2:
        pytest.skip("every stage count fits one rank")
    model, x, _, _ = make("resmlp")
    for bad in (n - 1, n + 1):
        with pytest.raises(ValueError, match=f"multiple of the group's {n} ranks"):
            commlib.pipeline.partition(model, bad, x, balance="params")


# -- single process ------------------------------------------------------------------------

def brute_force(costs, nbytes, blocked, stages):
    n = len(costs)
    best = None
    for cut in itertools.combinations(range(1, n), stages - 1):
        if any(blocked[c - 1] is not None for c in cut):
            continue
        bounds = (0, *cut, n)
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        sent = sum(nbytes[c - 1] for c in cut)
        if best is None or (worst, sent) < best[0]:
            best = ((worst, sent), [0, *cut])
    return best


def test_dynamic_program_equals_brute_force():
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(1, 9)
        stages = rng.randint(1, min(n, 4))
        costs = [float(rng.randint(0, 6)) for _ in range(n)]
        nbytes = [rng.randint(0, 5) for _ in range(n - 1)]
        blocked = [None if rng.random() < 0.75 else "x" for _ in range(n - 1)]
        expect = brute_force(costs, nbytes, blocked, stages)
        if expect is None:
            with pytest.raises(ValueError, match="no cut"):
                partitioner._solve(costs, nbytes, blocked, stages, 0)
            continue
        starts = partitioner._solve(costs, nbytes, blocked, stages, 0)
        bounds = starts + [n]
        got = (max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])),
               sum(nbytes[c - 1] for c in starts[1:]))
        assert got == expect[0], (trial, costs, nbytes, blocked, stages, starts, expect)
        assert all(blocked[c - 1] is None for c in starts[1:])


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_params_balance_on_known_layer_sizes(stages):
    """Linear layers of known sizes: the largest stage's parameter bytes are the brute-force
    optimum, and no larger than an equal-count split's."""
    widths = [3, 20, 4, 4, 30, 2, 9, 9, 3]
    torch.manual_seed(0)
    layers = [torch.nn.Linear(a, b).double() for a, b in zip(widths, widths[1:])]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(4, widths[0], dtype=torch.float64)
    p = commlib.pipeline.partition(model, stages, x, balance="params")
    sizes = [8 * (a * b + b) for a, b in zip(widths, widths[1:])]
    assert p.costs == sizes
    out_bytes = [8 * 4 * b for b in widths[1:-1]]
    (worst, sent), _ = brute_force(sizes, out_bytes, [None] * (len(sizes) - 1), stages)
    assert max(p.stage_costs) == worst and sum(p.boundary_bytes) == sent
    equal = commlib.pipeline.partition(model, stages, x, balance="params",
                                       cuts=[round(k * len(sizes) / stages)
                                             for k in range(1, stages)])
    assert max(p.stage_costs) <= max(equal.stage_costs)
    h = x
    for stage in p:
        h = stage(h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=0)


def test_untraceable_module_is_named():
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            if x.sum() > 0:   # data-dependent control flow
                return self.lin(x)
            return x

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(3, 3)
            self.branchy = Branchy()

        def forward(self, x):
            return self.branchy(self.first(x))

    with pytest.raises(TypeError, match="module 'branchy'"):
        commlib.pipeline.partition(Outer(), 1, torch.randn(4, 3), balance="params")
    # a plain nn.Sequential is cut by its children, untraced: the same parts work there
    seq = torch.nn.Sequential(torch.nn.Linear(3, 3), Branchy(), torch.nn.Linear(3, 2))
    x = torch.randn(4, 3)
    p = commlib.pipeline.partition(seq, 2, x, balance="params")
    assert len(p.nodes) == 3
    h = x
    for stage in p:
        h = stage(h)
    torch.testing.assert_close(h, seq(x), rtol=0, atol=0)


class SizeLater(torch.nn.Module):
    """Uses x.size(1) (an int) at the very end: a cut after it would carry an int."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(6, 6) for _ in range(3))

    def forward(self, x):
        n = x.size(1)
        h = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return h.reshape(-1, n // 2, 2)


def test_non_tensor_across_a_cut_is_refused_by_name():
    model, x = SizeLater().double(), torch.randn(4, 6, dtype=torch.float64)
    probe = commlib.pipeline.partition(model, 1, x, balance="params")
    assert probe.nodes[0] == "size"
    with pytest.raises(ValueError, match="node 'size' \\(int, not a tensor\\)"):
        commlib.pipeline.partition(model, 2, x, balance="params", cuts=["b"])
    # the dynamic program finds no place to cut (the int is used by the last node)
    with pytest.raises(ValueError, match="node 'size'"):
        commlib.pipeline.partition(model, 2, x, balance="params")


def test_sequential_repeating_a_module():
    """nn.Sequential(lin, tanh, lin): the repeated Linear is called twice (its weight then
    travels from the first call's stage to the second's)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).double()
    seq = torch.nn.Sequential(lin, torch.nn.Tanh(), lin)
    x = torch.randn(4, 4, dtype=torch.float64)
    for stages in (1, 2, 3):
        p = commlib.pipeline.partition(seq, stages, x, balance="params")
        h = x
        for stage in p:
            h = stage(h)
        torch.testing.assert_close(h, seq(x), rtol=0, atol=0)
        names = [n for s in p for n, _ in s.named_parameters()]
        assert sorted(names) == ["0.bias", "0.weight"]   # each held once
        if stages == 3:
            assert "_0_weight" in p.sent[0]


def test_more_stages_than_nodes():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
    with pytest.raises(ValueError, match="exceeds the 2 compute nodes"):
        commlib.pipeline.partition(model, 3, torch.randn(4, 3), balance="params")


def test_tie_that_cannot_travel_is_refused_by_name():
    """A LayerNorm used at both ends: its parameters would be in two stages."""
    class Sandwich(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(4)
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.norm(self.lin(self.norm(x)))

    with pytest.raises(ValueError, match="parameter 'norm.weight' is read by nodes 'norm' "
                                         "and 'norm_1'"):
        commlib.pipeline.partition(Sandwich(), 2, torch.randn(4, 4), balance="params")


def test_tied_head_travels_and_is_held_once():
    model, x, _, _ = make("gpt")
    ref = copy.deepcopy(model)
    p = commlib.pipeline.partition(model, 3, x, balance="params")
    owners = [k for k, s in enumerate(p) if any(n == "wte.weight" for n, _ in
                                                 s.named_parameters())]
    assert owners == [0]
    assert all("wte_weight" in sent for sent in p.sent)
    names = [n for s in p for n, _ in s.named_parameters()]
    assert len(names) == len(set(names)) and "head.weight" not in names
    h = x
    for stage in p:
        h = stage(h)
    torch.testing.assert_close(h, ref(x), rtol=0, atol=0)


def test_untied_gpt_sends_no_weight():
    torch.manual_seed(0)
    model = GPT(tie=False).double()
    x = torch.randint(0, 11, (4, 6))
    p = commlib.pipeline.partition(model, 3, x, balance="params")
    assert not any("weight" in v for sent in p.sent for v in sent)


def test_partition_leaves_model_state_alone():
    """Profiling runs the model: BatchNorm statistics, the RNG and .grad are as before."""
    model, x, _, _ = make("rescnn")
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    commlib.pipeline.partition(model, 2, x, balance="time", repeats=1)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("bad, kind, match", [
    (dict(num_stages=0), ValueError, "'num_stages'=0"),
    (dict(balance="flops"), ValueError, "'balance'='flops'"),
    (dict(example_inputs=(torch.randn(4, 5), torch.randn(4, 5))), TypeError,
     "'example_inputs' must be one tensor"),
    (dict(example_inputs=torch.randn(1, 5)), ValueError, "at least 2 rows"),
    (dict(cuts=["nope"]), ValueError, "names node 'nope'"),
    (dict(cuts=[3, 2]), ValueError, "increasing node indices"),
    (dict(model="not a module"), TypeError, "'model' must be a torch.nn.Module"),
])
def test_bad_arguments(bad, kind, match):
    args = dict(model=ResMLP().double(), num_stages=3,
                example_inputs=torch.randn(4, 5, dtype=torch.float64), balance="params")
    args.update(bad)
    with pytest.raises(kind, match=match):
        commlib.pipeline.partition(**args)
