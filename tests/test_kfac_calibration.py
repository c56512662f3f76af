"""K-FAC calibration: factors and KL clipping do not depend on how the loss was scaled or
split. A loss scale ``s`` (``torch.amp.GradScaler`` or a callable) gives the factors,
gradients and parameters of the unscaled run; ``k`` micro-batches with ``loss / k`` give
those of the whole batch; KL clipping follows the learning rate of a scheduler (read from
the optimizer, or given as a callable). float64, compared to 1e-10."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import commlib  # noqa: E402
from test_kfac_dist import LR, build, kfac_modules, shard  # noqa: E402
from test_kfac_math import (  # noqa: E402
    ReferenceKFAC,
    grad_matrix,
    reference_factors,
    set_grad_matrix,
)

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")

ALGORITHMS = ["d_kfac", "dp_kfac"]
HP = dict(damping=0.01, kl_clip=1e-4, lr=0.5, bucket_cap_mb=0.001)  # the clip binds


def world():
    return commlib.get_rank(), commlib.get_world_size()


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def assert_close(actual, expected, what, rel=1e-10):
    err = float((actual - expected).abs().max())
    assert err <= rel * float(expected.abs().max()), f"{what}: off by {err:.3e}"


def factors_of(ddp):
    held = ddp.algorithm.held_factors()
    return {k: [t.clone() for t in ag] for k, ag in held.items()}


def assert_same_factors(a, b, what):
    assert set(a) == set(b), what
    for k in a:
        for t, u, name in zip(a[k], b[k], "AG"):
            assert_close(t, u, f"{what}: factor {name} of {k!r}")


def run(algorithm, steps, step_fn, **hp):
    """``step_fn(ddp, opt, step)`` does one iteration; returns per step (factors,
    parameters) and the wrapper (closed)."""
    ddp = commlib.DistributedDataParallel(build("cnn"), algorithm=algorithm, **hp)
    assert len(ddp._ctx.buckets) >= 3
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    seen = []
    try:
        for step in range(steps):
            opt.zero_grad()
            step_fn(ddp, opt, step)
            seen.append((factors_of(ddp), flat(ddp.parameters()).clone()))
    finally:
        ddp.close()
    return seen


def plain_step(ddp, opt, step):
    rank, _ = world()
    x, y = shard("cnn", step, rank)
    F.cross_entropy(ddp(x), y).backward()
    opt.step()


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("scaler_kind", ["GradScaler", "callable"])
def test_loss_scale_changes_neither_factors_nor_steps(algorithm, scaler_kind):
    rank, _ = world()
    plain = run(algorithm, 3, plain_step, **HP)
    scales = []

    if scaler_kind == "GradScaler":  # the scale doubles after every step
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
        source = scaler
    else:
        scaler, source = None, lambda: scales[-1]

    def scaled_step(ddp, opt, step):
        x, y = shard("cnn", step, rank)
        loss = F.cross_entropy(ddp(x), y)
        if scaler is not None:
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            scales.append(2.0 ** (12 + step))
            (loss * scales[-1]).backward()
            for p in ddp.parameters():
                p.grad.div_(scales[-1])
            opt.step()

    scaled = run(algorithm, 3, scaled_step, grad_scaler=source, **HP)
    assert len(set(scales)) == 3, scales  # a different scale at every step
    for step, ((fa, pa), (fb, pb)) in enumerate(zip(scaled, plain)):
        assert_same_factors(fa, fb, f"step {step}")
        assert_close(pa, pb, f"step {step}: parameters")


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_micro_batches_with_divided_loss_equal_the_whole_batch(algorithm):
    rank, _ = world()
    k = 3

    def whole_step(ddp, opt, step):
        parts = [shard("cnn", 10 * step + j, rank) for j in range(k)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        F.cross_entropy(ddp(x), y).backward()
        opt.step()

    def micro_step(ddp, opt, step):
        for j in range(k):
            x, y = shard("cnn", 10 * step + j, rank)
            if j < k - 1:
                with ddp.no_sync():
                    (F.cross_entropy(ddp(x), y) / k).backward()
            else:
                (F.cross_entropy(ddp(x), y) / k).backward()
        opt.step()

    whole = run(algorithm, 2, whole_step, **HP)
    micro = run(algorithm, 2, micro_step, accumulation_steps=k, **HP)
    for step, ((fa, pa), (fb, pb)) in enumerate(zip(micro, whole)):
        assert_same_factors(fa, fb, f"step {step}")
        assert_close(pa, pb, f"step {step}: parameters")


def schedule(step):
    return 0.5 * 0.5 ** step  # halves every iteration


def scheduled_run(algorithm, lr):
    """d_kfac/dp_kfac with a binding KL clip and an LR scheduler, against single-process
    K-FAC whose clip uses the scheduler's rate of each step; returns the reference's clip
    scales. Raises AssertionError when the parameters leave the reference's."""
    rank, n = world()
    hp = dict(damping=0.01, kl_clip=1e-4)
    ddp = commlib.DistributedDataParallel(build("cnn"), algorithm=algorithm, lr=lr,
                                          bucket_cap_mb=0.001, **hp)
    ref, ref_kfac = build("cnn"), ReferenceKFAC(**hp)
    owners = ddp.algorithm.owners() if algorithm == "dp_kfac" else None
    opt = torch.optim.SGD(ddp.parameters(), lr=schedule(0))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=schedule(0))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s) / schedule(0))
    scales = []
    try:
        for step in range(4):
            shards = [shard("cnn", step, r) for r in range(n)]
            opt.zero_grad()
            F.cross_entropy(ddp(shards[rank][0]), shards[rank][1]).backward()
            opt.step()
            sched.step()
            ref_kfac.lr = schedule(step)
            ref_opt.param_groups[0]["lr"] = schedule(step)
            ref_opt.zero_grad()
            x, y = torch.cat([s[0] for s in shards]), torch.cat([s[1] for s in shards])
            if owners is None:
                factors = reference_factors(ref, x, y, F.cross_entropy)
            else:
                per = [reference_factors(ref, *s, F.cross_entropy) for s in shards]
                factors = {name: per[r][name] for name, r in owners.items()}
            ref_kfac.update(step, factors)
            F.cross_entropy(ref(x), y).backward()
            mods = dict(kfac_modules(ref))
            pre = ref_kfac.precondition({name: grad_matrix(m) for name, m in mods.items()})
            for name, v in pre.items():
                set_grad_matrix(mods[name], v)
            ref_opt.step()
            scales.append(ref_kfac.last_scale)
            assert_close(flat(ddp.parameters()), flat(ref.parameters()),
                         f"step {step}: parameters", rel=1e-8)
    finally:
        ddp.close()
    return scales


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_kl_clip_follows_the_scheduler(algorithm):
    scales = scheduled_run(algorithm, lr=None)  # read from the optimizer at step time
    assert min(scales) < 1.0  # the clip binds
    scheduled_run(algorithm, lr=schedule)       # the same schedule as a callable
    with pytest.raises(AssertionError):         # a constant rate: clipping miscalibrated
        scheduled_run(algorithm, lr=schedule(0))
