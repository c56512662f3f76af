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


def reference_step(model, opt, xs, ys, lossf):
    """One process: the replicas' batches, each by micro-batches, gradients averaged."""
    opt.zero_grad()
    total = 0.0
    for x, y in zip(xs, ys):
        for xm, ym in zip(torch.tensor_split(x, MICRO), torch.tensor_split(y, MICRO)):
            loss = lossf(model(xm), ym)
            total += loss.item()
            (loss / (MICRO * len(xs))).backward()
    opt.step()
    return total / (MICRO * len(xs))


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
    names_ok = set(state) <= set(ref_state)
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
