"""Saving and resuming algorithms.

In new processes (``resume_program.py`` under mpiexec, every built-in algorithm in one job):
train K iterations, save model, optimizer and algorithm state per rank, exit; a second job
loads them and trains K more; the result is bit-identical to an uninterrupted run of 2K
iterations for every deterministic algorithm (all but async_model_average, whose
background rounds depend on timing: for it, the loaded state must equal the saved one and
background averaging must run again). Resuming without the algorithm state must differ
(the comparison can fail).

In process: ``QAdamOptimizer.load_state_dict`` keeps the optimizer bound to the
algorithm's buffers, and loading refuses states that do not fit, naming what differs.
"""
from __future__ import annotations

import copy
import os

import pytest

torch = pytest.importorskip("torch")

import commlib  # noqa: E402
from algo_harness import BUCKET_MB, model, param_groups  # noqa: E402
from helpers import require, run_mpi, serial_only  # noqa: E402

require("sklearn")
from resume_program import CONFIGS, NEEDS_STATE, TIMED, same, train  # noqa: E402

PROGRAM = os.path.join(os.path.dirname(__file__), "resume_program.py")
K = 4


@serial_only
@pytest.mark.parametrize("n", [3])  # 2 ranks run the same code (CI time)
def test_every_algorithm_resumes_exactly_in_new_processes(n, tmp_path):
    for mode in ("first", "second"):
        code, seconds, out = run_mpi(n, [PROGRAM, mode, str(tmp_path), str(K)], timeout=600,
                                     COMMLIB_TIMEOUT="120", OMP_NUM_THREADS="1")
        assert code == 0, f"{mode} job failed ({code}):\n{out[-4000:]}"
    for name in CONFIGS:
        for rank in range(n):
            load = lambda kind: torch.load(tmp_path / f"{name}.{kind}.{rank}",  # noqa: E731
                                           weights_only=False)
            full, resumed = load("full"), load("resumed")
            assert resumed["restored"], f"{name}, rank {rank}: the loaded state differs from " \
                                        f"the saved one"
            if name in TIMED:
                checkpoint = load("ckpt")
                assert resumed["rounds"] >= 2, f"{name}: no background round after resuming"
                params = torch.cat([t.reshape(-1) for t in resumed["model"].values()])
                before = torch.cat([t.reshape(-1) for t in checkpoint["model"].values()])
                assert torch.isfinite(params).all() and not torch.equal(params, before)
                continue
            for key in ("model", "optimizer", "algorithm"):
                assert same(resumed[key], full[key]), \
                    f"{name}, rank {rank}: {key} state differs from the uninterrupted run"
            if name in NEEDS_STATE:
                skipped = load("skipped")
                assert not same(skipped["model"], full["model"]), \
                    f"{name}: resuming without the algorithm state should not be exact"


# -- in process ------------------------------------------------------------------------
def _qadam(warmup=2, compression="sign1"):
    from commlib.algorithms.qadam import QAdamOptimizer
    ddp = commlib.DistributedDataParallel(model(), algorithm="qadam", warmup_steps=warmup,
                                          compression=compression, bucket_cap_mb=BUCKET_MB)
    return ddp, QAdamOptimizer(param_groups(ddp.module), lr=0.01)


@pytest.mark.mpi
@pytest.mark.parametrize("order,compression", [("optimizer_first", "sign1"),
                                               ("algorithm_first", "sign1"),
                                               ("optimizer_only", "minmax_uint8")])
def test_qadam_rollback_in_process_keeps_the_optimizer_bound(order, compression):
    """Save after 4 iterations, take 2 more, load the saved states back (the optimizer
    already holds views into the algorithm's buffers) and train 4: the same as 8
    uninterrupted iterations, bitwise. With min-max compression (no residuals) the
    optimizer's state alone (momentum, frozen denominators) is all qadam needs after
    the warm-up: loading it must write the algorithm's buffers, which it keeps viewing."""
    ddp, opt = _qadam(compression=compression)
    try:
        train(ddp, opt, 0, 8)
        expected = [p.detach().clone() for p in ddp.parameters()]
    finally:
        ddp.close()
    ddp, opt = _qadam(compression=compression)
    try:
        train(ddp, opt, 0, 4)
        saved = (copy.deepcopy(ddp.module.state_dict()), copy.deepcopy(opt.state_dict()),
                 ddp.algorithm.state_dict())
        train(ddp, opt, 4, 6)
        ddp.module.load_state_dict(saved[0])
        if order == "algorithm_first":
            ddp.algorithm.load_state_dict(saved[2])
        opt.load_state_dict(saved[1])
        if order == "optimizer_first":
            ddp.algorithm.load_state_dict(saved[2])
        algo = ddp.algorithm
        if order == "optimizer_only":  # bound again at once, holding the loaded values
            for bucket, m in zip(algo._ctx.buckets, algo._momentum):
                for p, offset, numel in zip(bucket.tensors, bucket.offsets, bucket.numels):
                    view = opt.state[p]["exp_avg"]
                    assert view.data_ptr() == m[offset:offset + numel].data_ptr()
        train(ddp, opt, 4, 8)
        for a, b in zip(ddp.parameters(), expected):
            assert torch.equal(a, b)
        for bucket, m in zip(algo._ctx.buckets, algo._momentum):
            for p, offset in zip(bucket.tensors, bucket.offsets):
                assert opt.state[p]["exp_avg"].data_ptr() == m[offset:].data_ptr()
    finally:
        ddp.close()


def _raises(match, fn):
    with pytest.raises(ValueError, match=match):
        fn()


@pytest.mark.mpi
def test_load_state_dict_refuses_what_does_not_fit():
    rank, n = commlib.get_rank(), commlib.get_world_size()
    ddp, opt = _qadam(warmup=1)
    other = commlib.DistributedDataParallel(model(), algorithm="qadam", bucket_cap_mb=25)
    lowp = commlib.DistributedDataParallel(model(), algorithm="low_precision_decentralized",
                                           bucket_cap_mb=BUCKET_MB)
    try:
        train(ddp, opt, 0, 3)
        state = ddp.algorithm.state_dict()
        before = ddp.algorithm.state_dict()
        _raises("the algorithm differs", lambda: lowp.algorithm.load_state_dict(state))
        _raises("buckets", lambda: other.algorithm.load_state_dict(state))
        bad = copy.deepcopy(state)
        bad["state"]["momentum"][1] = bad["state"]["momentum"][1][:-1]
        _raises("momentum of bucket 1 has shape", lambda: ddp.algorithm.load_state_dict(bad))
        bad = copy.deepcopy(state)
        del bad["state"]["residuals"]
        _raises("lacks", lambda: ddp.algorithm.load_state_dict(bad))
        assert same(ddp.algorithm.state_dict(), before)  # nothing changed
        if n > 1:
            theirs = lowp.algorithm.state_dict()
            theirs["rank"] = (rank + 1) % n
            _raises(f"rank .*{rank}", lambda: lowp.algorithm.load_state_dict(theirs))
            theirs["rank"], theirs["world_size"] = rank, n + 1
            _raises("world size", lambda: lowp.algorithm.load_state_dict(theirs))
        with pytest.raises(RuntimeError, match="not attached"):
            commlib.algorithms.get("qadam").state_dict()
    finally:
        for d in (ddp, other, lowp):
            d.close()
