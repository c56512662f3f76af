"""commlib.parallel.auto: one call from a model to a dp x pp x tp trainer.

Every layout of the world (pp, tp, dp with pp * tp * dp = ranks, a few per world size) on
the residual MLP and the tied-head GPT of partition_models: the losses of several AdamW
steps, the replicated parameters (by name), the eval output and the state_dict names equal
one process in float64 (gradient accumulation over the micro-batches and the replicas'
batches). A layout whose data-parallel average is skipped is caught by the same check.
"""
import copy

import numpy as np
import pytest
import torch

import commlib
from partition_models import make

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("one_thread_per_rank")]

MICRO, STEPS = 2, 3


def layouts(n):
    out = [(n, 1, 1)]
    for pp, tp, dp in [(1, n, 1), (1, 1, n), (2, n // 2, 1), (2, 1, n // 2), (1, 2, n // 2)]:
        if pp * tp * dp == n and (pp, tp, dp) not in out:
            out.append((pp, tp, dp))
    return out


def reference_step(model, opt, xs, ys, lossf, micro=MICRO):
    """One process: the replicas' batches, each by micro-batches, gradients averaged."""
    opt.zero_grad()
    total = 0.0
    for x, y in zip(xs, ys):
        for xm, ym in zip(torch.tensor_split(x, micro), torch.tensor_split(y, micro)):
            loss = lossf(model(xm), ym)
            total += loss.item()
            (loss / (micro * len(xs))).backward()
    opt.step()
    return total / (micro * len(xs))


def compare(trainer, ref, x):
    """(largest difference of this rank's replicated parameters from ``ref``'s, of the
    eval output on ``x``, this rank's state dict, the names of its sharded parameters)."""
    state = trainer.state_dict()
    sharded = {k for s in trainer.pipeline.local_ids
               for k, q in trainer.partition[s].named_parameters()
               if getattr(q, "tensor_parallel", False)}
    ref_state = ref.state_dict(keep_vars=True)
    param_err = max([(state[k].double() - ref_state[k].detach().double()).abs().max().item()
                     for k in state if k not in sharded] + [0.0])
    with torch.no_grad():
        expect = ref(x)
    eval_err = (trainer.eval_step(x) - expect).abs().max().item()
    return param_err, eval_err, state, sharded


def run(name, pp, tp, dp, skip_dp=False):
    model, x, y, lossf = make(name, seed=pp * 16 + tp * 4 + dp)
    ref = copy.deepcopy(model)
    trainer = commlib.parallel.auto(model, x, pp=pp, tp=tp, dp=dp, loss_fn=lossf,
                                    micro_batches=MICRO, balance="params", min_params=16)
    if skip_dp:
        trainer.pipeline.dp_group = None
    me = trainer.topology.coord.dp
    g = torch.Generator().manual_seed(7)
    opt = torch.optim.AdamW(trainer.parameters(), lr=0.01, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    loss_err = 0.0
    for _ in range(STEPS):
        # each replica its own rows (distinct data: an unaveraged replica would drift)
        idx = [torch.randperm(x.shape[0], generator=g)[:x.shape[0] - 3] for _ in range(dp)]
        xs, ys = [x[i] for i in idx], [y[i] for i in idx]
        opt.zero_grad()
        loss = trainer.train_step(xs[me], ys[me])
        opt.step()
        loss_err = max(loss_err, abs(loss - reference_step(ref, ref_opt, xs, ys, lossf)))
    param_err, eval_err, state, sharded = compare(trainer, ref, x)
    names_ok = set(state) <= set(ref.state_dict())
    if tp > 1:   # the layout really shards: some Linear of this rank is split
        names_ok &= len(sharded) > 0
    trainer.close()
    return loss_err, param_err, eval_err, names_ok


@pytest.mark.parametrize("name", ["resmlp", "gpt"])
def test_auto_equals_one_process_in_every_layout(name):
    n = commlib.get_world_size()
    for pp, tp, dp in layouts(n):
        loss_err, param_err, eval_err, names_ok = run(name, pp, tp, dp)
        where = f"rank {commlib.get_rank()} pp={pp} tp={tp} dp={dp}"
        assert loss_err < 1e-10, where
        assert param_err < 1e-10, where
        assert eval_err < 1e-10, where
        assert names_ok, where


def test_negative_control_unaveraged_replicas_are_caught():
    n = commlib.get_world_size()
    if n < 2:
        pytest.skip("no data-parallel replicas at one rank")
    loss_err, param_err, eval_err, _ = run("resmlp", 1, 1, n, skip_dp=True)
    errs = commlib.allgather(np.array([param_err, eval_err]))
    assert errs.max() > 1e-6


def test_bad_layout_is_refused():
    n = commlib.get_world_size()
    model, x, _, lossf = make("resmlp")
    with pytest.raises(ValueError, match="world"):
        commlib.parallel.auto(model, x, pp=n + 1, dp=1, loss_fn=lossf)


# -- data parallelism by commlib's DDP algorithms (auto(..., algorithm=...)) -------------

def dp_layouts(n):
    """Layouts with data-parallel replicas (pp, tp, dp, schedule)."""
    out = [(1, 1, n, "1f1b")] if n > 1 else []
    if n == 4:
        out += [(2, 1, 2, "gpipe"), (2, 1, 2, "interleaved"), (2, 1, 2, "chimera"),
                (1, 2, 2, "1f1b")]
    return out


def run_ddp(name, pp, tp, dp, schedule, steps, algorithm, ddp_kwargs=None, average=None,
            sabotage=False):
    """``auto`` with ``algorithm`` against one process holding ``dp`` replicas, each
    trained on its own rows by micro-batches, the replicas' parameters averaged after the
    steps in ``average`` (None: the gradients are averaged every step). Returns this
    rank's largest differences (loss, parameters, eval output) from its replica."""
    model, x, y, lossf = make(name, seed=pp * 16 + tp * 4 + dp + 1)
    refs = [copy.deepcopy(model) for _ in range(dp if average is not None else 1)]
    trainer = commlib.parallel.auto(model, x, pp=pp, tp=tp, dp=dp, loss_fn=lossf,
                                    micro_batches=2 * MICRO, balance="params",
                                    min_params=16, schedule=schedule,
                                    algorithm=algorithm, ddp_kwargs=ddp_kwargs)
    assert trainer.ddp and trainer.pipeline.dp_group is None
    if sabotage:   # exchange at the first backward of each stage instead of its last
        first = {}
        for a in trainer.pipeline.actions:
            if a.kind == "backward":
                first.setdefault(a.stage, (a.pipe, a.micro))
        trainer.pipeline._last_backward = first
    me = trainer.topology.coord.dp
    g = torch.Generator().manual_seed(11)
    opt = torch.optim.SGD(trainer.parameters(), lr=0.05, momentum=0.9)
    ref_opts = [torch.optim.SGD(r.parameters(), lr=0.05, momentum=0.9) for r in refs]
    loss_err = 0.0
    for step in range(1, steps + 1):
        idx = [torch.randperm(x.shape[0], generator=g)[:x.shape[0] - 2] for _ in range(dp)]
        xs, ys = [x[i] for i in idx], [y[i] for i in idx]
        opt.zero_grad()
        loss = trainer.train_step(xs[me], ys[me])
        opt.step()
        if average is None:
            expect = reference_step(refs[0], ref_opts[0], xs, ys, lossf, 2 * MICRO)
        else:
            expect = sum(reference_step(r, o, [xr], [yr], lossf, 2 * MICRO)
                         for r, o, xr, yr in zip(refs, ref_opts, xs, ys)) / dp
            if step in average:
                with torch.no_grad():
                    for ps in zip(*(r.parameters() for r in refs)):
                        mean = sum(p.detach() for p in ps) / dp
                        for p in ps:
                            p.copy_(mean)
        loss_err = max(loss_err, abs(loss - expect))
    ref = refs[me] if average is not None else refs[0]
    if average is not None and steps in average:
        for w in trainer.ddp:   # the average due after the last step, applied now
            w.average_parameters()
    param_err, eval_err, _, _ = compare(trainer, ref, x)
    trainer.close()
    return loss_err, param_err, eval_err


def test_auto_with_gradient_allreduce_ddp_equals_one_process():
    """Each stage in commlib's DDP (exchange at the stage's last backward), every
    schedule that fits: equal to one process, as the plain average."""
    n = commlib.get_world_size()
    if n < 2:
        pytest.skip("no data-parallel replicas at one rank")
    for pp, tp, dp, schedule in dp_layouts(n):
        errs = run_ddp("resmlp", pp, tp, dp, schedule, 3, "gradient_allreduce")
        where = f"rank {commlib.get_rank()} pp={pp} tp={tp} dp={dp} {schedule}"
        assert max(errs) < 1e-10, (where, errs)


def test_auto_exchanging_at_the_wrong_backward_is_caught():
    """Negative control: exchanging at each stage's first backward (the later
    micro-batches' gradients left out of the average) breaks the equality above."""
    n = commlib.get_world_size()
    if n < 2:
        pytest.skip("no data-parallel replicas at one rank")
    errs = run_ddp("resmlp", 1, 1, n, "1f1b", 2, "gradient_allreduce", sabotage=True)
    worst = commlib.allgather(np.array(errs[1:]))
    assert worst.max() > 1e-6


@pytest.mark.parametrize("layout", ["dp", "pp"])
def test_auto_with_local_sgd_equals_the_papers_replicas(layout):
    """local_sgd over dp (sync_every=2, 5 steps): every rank's replica equals its own
    replica of a one-process reference whose replicas train alone and are averaged after
    steps 2 and 4 (and 5, by average_parameters); a variant that never averages within
    the run (sync_every=100) is rejected by the same check."""
    n = commlib.get_world_size()
    if n < 2 or (layout == "pp" and n != 4):
        pytest.skip("needs dp > 1 (and pp=2 x dp=2 at 4 ranks)")
    pp, dp = (1, n) if layout == "dp" else (2, 2)
    errs = run_ddp("resmlp", pp, 1, dp, "1f1b", 5, "local_sgd", {"sync_every": 2},
                   average={2, 4, 5})
    assert max(errs[1:]) < 1e-10, (commlib.get_rank(), errs)
    bad = run_ddp("resmlp", pp, 1, dp, "1f1b", 5, "local_sgd", {"sync_every": 100},
                  average={2, 4})
    worst = commlib.allgather(np.array(bad[1:]))
    assert worst.max() > 1e-6
