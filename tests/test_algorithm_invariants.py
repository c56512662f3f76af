"""Per-iteration invariants of the algorithms, checked at every step in float64 on the
harness problem (three buckets, two param groups), each against a reference computed by
the test from every rank's data; and for each, deliberately broken variants that the same
check must reject.

* gradient_allreduce: after backward, ``p.grad`` is the mean of the ranks' local gradients.
* bytegrad: after backward, gradients are bitwise identical everywhere and within the
  quantization bound of the mean.
* qadam: see test_qadam_reference.py.
* decentralized: before the optimizer step, the weights are the peer average of the
  weights the forward saw.
* local_sgd: after each ``sync_every``-th iteration the replicas are the mean of the
  locally stepped ones; in between nothing touches them.
* low_precision_decentralized: every rank's copy of a neighbour equals that neighbour's
  public weights bitwise, the weights equal the public ones, and consensus is reached.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest

from helpers import require

torch = pytest.importorskip("torch")
require("sklearn")
import torch.nn.functional as F  # noqa: E402

import broken_algorithms as broken  # noqa: E402
import commlib  # noqa: E402
from algo_harness import (  # noqa: E402
    BUCKET_MB,
    batch_indices,
    digits,
    gathered,
    model,
    param_groups,
)
from commlib.algorithms.buckets import pack  # noqa: E402
from commlib.primitives import ring_neighbors, shift_one_peer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")

D = torch.float64


def world():
    return commlib.get_rank(), commlib.get_world_size()


def run(algorithm, steps, before_forward=None, after_backward=None, before_step=None,
        after_step=None, optimizer=None, lr=0.1, **kwargs):
    """Train in float64; the callbacks get ``(ddp, step, x, y)`` (``before_step`` runs
    after the wrapper's own pre-step hook). Callbacks make their collectives before they
    assert; a failed check is held until the end of the iteration, when every rank learns
    whether any rank failed and all raise ``AssertionError`` together (so no rank is left
    waiting in a collective). Returns the wrapper (closed)."""
    rank, n = world()
    xs, ys = digits(D)
    ddp = commlib.DistributedDataParallel(model(D), algorithm=algorithm,
                                          bucket_cap_mb=BUCKET_MB, **kwargs)
    assert len(ddp._ctx.buckets) >= 3
    opt = (torch.optim.SGD(param_groups(ddp.module), lr=lr, momentum=0.9)
           if optimizer is None else optimizer(ddp))
    current, failures = {}, []

    def call(callback):
        if callback is not None:
            try:
                callback(ddp, current["step"], *current["batch"])
            except AssertionError as exc:
                failures.append(str(exc))

    handles = [ddp.module.register_forward_pre_hook(lambda m, a: call(before_forward)),
               opt.register_step_pre_hook(lambda o, a, k: call(before_step))]
    try:
        for step in range(steps):
            idx = batch_indices(rank, n, step)
            current.update(step=step, batch=(xs[idx], ys[idx]))
            opt.zero_grad()
            F.cross_entropy(ddp(xs[idx]), ys[idx]).backward()
            call(after_backward)
            opt.step()
            call(after_step)
            failed = commlib.allreduce(np.array([len(failures)]), op=commlib.ReduceOp.MAX)
            if failed[0]:
                raise AssertionError(f"rank {rank}: {failures[:2] or 'another rank failed'}")
    finally:
        for h in handles:
            h.remove()
        ddp.close()
    return ddp


def assert_rejected(check_run, *controls):
    """Each negative control must fail the check (only meaningful with peers)."""
    if commlib.get_world_size() == 1:
        return
    for control in controls:
        with pytest.raises(AssertionError):
            check_run(control)


def local_gradients(module, x, y):
    """This rank's own gradients at the module's current weights (on a copy)."""
    clone = copy.deepcopy(module)
    clone.zero_grad()
    F.cross_entropy(clone(x), y).backward()
    return [p.grad.detach().clone() for p in clone.parameters()]


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors]).numpy()


def assert_close(actual, expected, rel, what):
    scale = max(float(np.max(np.abs(expected))), 1e-300)
    err = float(np.max(np.abs(actual - expected)))
    assert err <= rel * scale, f"{what}: off by {err:.3e} (allowed {rel * scale:.3e})"


# -- gradient_allreduce ---------------------------------------------------------------
def mean_gradient_check(ddp, step, x, y):
    mean = gathered(local_gradients(ddp.module, x, y)).mean(0)
    assert_close(flat(p.grad for p in ddp.module.parameters()), mean, 1e-12,
                 f"step {step}: gradients vs the mean of local gradients")


@pytest.mark.mpi
def test_gradient_allreduce_gradients_are_the_mean_every_step():
    def check_run(algorithm):
        run(algorithm, steps=4, after_backward=mean_gradient_check)

    check_run("gradient_allreduce")
    assert_rejected(check_run, broken.SilentGradients(), broken.DropBucketGradients(),
                    broken.StaleGradients())


# -- bytegrad --------------------------------------------------------------------------
def bytegrad_check(ddp, step, x, y):
    local = gathered(local_gradients(ddp.module, x, y))
    grads = gathered([p.grad for p in ddp.module.parameters()])
    mine = grads[commlib.get_rank()]
    assert all(np.array_equal(g, mine) for g in grads), \
        f"step {step}: gradients differ between ranks"
    # Two min-max uint8 quantizations of ranges within the local gradients' overall range
    # R: each element is within R / 510 per compression of the exact mean (R / 200 leaves
    # room for float32 rounding).
    bound = float(local.max() - local.min()) / 200
    err = float(np.max(np.abs(mine - local.mean(0))))
    assert err <= bound, f"step {step}: off the mean by {err:.3e}, bound {bound:.3e}"


@pytest.mark.mpi
def test_bytegrad_gradients_are_identical_and_within_the_quantization_bound():
    def check_run(algorithm):
        run(algorithm, steps=4, after_backward=bytegrad_check)

    check_run("bytegrad")
    assert_rejected(check_run, broken.SilentGradients(), broken.DropBucketByteGrad())


# -- decentralized ---------------------------------------------------------------------
def decentralized_check(mode):
    seen = {}

    def before_forward(ddp, step, x, y):
        seen["weights"] = gathered(ddp.module.parameters())

    def before_step(ddp, step, x, y):
        rank, n = world()
        everyone = seen["weights"]
        if mode == "all":
            expected = everyone.mean(0)
        else:
            peer = shift_one_peer(rank, n, step)
            expected = everyone[rank] if peer is None else (everyone[rank] + everyone[peer]) / 2
        assert_close(flat(ddp.module.parameters()), expected, 1e-12,
                     f"step {step}: weights before the step vs the peer average")

    return dict(before_forward=before_forward, before_step=before_step)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["all", "shift_one"])
def test_decentralized_steps_from_the_peer_average(mode):
    def check_run(algorithm):
        run(algorithm, steps=5, **decentralized_check(mode))

    check_run(commlib.algorithms.get("decentralized", peer_selection_mode=mode))
    assert_rejected(check_run, broken.SilentWeights(),
                    broken.DropBucketDecentralized(peer_selection_mode=mode),
                    broken.StaleDecentralized(peer_selection_mode=mode))


# -- local_sgd -------------------------------------------------------------------------
def local_sgd_check(k):
    seen = {}

    def after_step(ddp, step, x, y):
        seen["stepped"] = gathered(ddp.module.parameters())

    def before_forward(ddp, step, x, y):
        rank, _ = world()
        if step == 0:
            return
        now = flat(ddp.module.parameters())
        everyone = gathered(ddp.module.parameters())
        if step % k == 0:  # the average after iteration step - 1 (ctx.step == step)
            assert_close(now, seen["stepped"].mean(0), 1e-12, f"iteration {step}: average")
            assert all(np.array_equal(w, now) for w in everyone), \
                f"iteration {step}: replicas differ right after the average"
        else:
            assert np.array_equal(now, seen["stepped"][rank]), \
                f"iteration {step}: weights changed between averages"

    return dict(after_step=after_step, before_forward=before_forward)


@pytest.mark.mpi
def test_local_sgd_averages_exactly_every_kth_iteration_and_only_then():
    k = 3

    def check_run(algorithm):
        run(algorithm, steps=8, **local_sgd_check(k))

    check_run(commlib.algorithms.get("local_sgd", sync_every=k))
    assert_rejected(check_run, broken.SilentWeights(), broken.DropBucketLocalSGD(sync_every=k),
                    broken.StaleLocalSGD(sync_every=k))


# -- low_precision_decentralized -------------------------------------------------------
def replicas_check(ddp, step, x, y):
    """At the start of every iteration after the first (the gossip of the last one done):
    each rank's ``left``/``right`` replica equals its neighbour's ``pub`` bitwise, and its
    weights equal its own ``pub``."""
    if step == 0:
        return
    rank, n = world()
    reps = getattr(ddp.algorithm, "_replicas", None) or [None] * len(ddp._ctx.buckets)
    public = [gathered([rep["pub"] if rep else pack(b)]) for b, rep in zip(ddp._ctx.buckets, reps)]
    assert all(reps), "no replicas"
    left, right = ring_neighbors(rank, n)
    for k, (bucket, rep, pubs) in enumerate(zip(ddp._ctx.buckets, reps, public)):
        assert np.array_equal(flat([pack(bucket)]), pubs[rank]), \
            f"iteration {step}, bucket {k}: weights differ from the public copy"
        assert np.array_equal(flat([rep["left"]]), pubs[left]), \
            f"iteration {step}, bucket {k}: copy of the left neighbour is off"
        assert np.array_equal(flat([rep["right"]]), pubs[right]), \
            f"iteration {step}, bucket {k}: copy of the right neighbour is off"


def consensus(algorithm, train_steps=10, gossip_steps=40, check_replicas=True):
    """Train, then gossip with a zero learning rate, checking the replicas at every
    iteration (``check_replicas``); returns the spread between ranks' weights (largest
    difference relative to the largest weight) at the end."""
    out = {}

    def after_step(ddp, step, x, y):
        if step == train_steps - 1:
            for opt_group in out["opt"].param_groups:
                opt_group["lr"] = 0.0
                opt_group["momentum"] = 0.0

    def optimizer(ddp):
        out["opt"] = torch.optim.SGD(param_groups(ddp.module), lr=0.1, momentum=0.9)
        return out["opt"]

    def before_forward(ddp, step, x, y):
        if step == train_steps + gossip_steps - 1:
            everyone = gathered(ddp.module.parameters())
            out["spread"] = float(np.max(everyone.max(0) - everyone.min(0))
                                  / np.max(np.abs(everyone)))
        if check_replicas:
            replicas_check(ddp, step, x, y)

    run(algorithm, steps=train_steps + gossip_steps, optimizer=optimizer,
        before_forward=before_forward, after_step=after_step)
    return out["spread"]


@pytest.mark.mpi(min_size=2)
def test_low_precision_decentralized_replicas_match_their_neighbours_every_step():
    """DCD-PSGD's invariant holds at every iteration and the ranks reach consensus; a
    variant whose replicas start after the first local step, or that skips the replica
    update, is rejected by the same check."""
    spread = consensus("low_precision_decentralized")
    assert spread < 1e-4, spread
    assert_rejected(consensus, broken.LateInitLowPrecision(),
                    broken.NoReplicaUpdateLowPrecision(), broken.SilentWeights())


@pytest.mark.mpi(min_size=2)
def test_low_precision_decentralized_late_start_stalls_consensus():
    """Without the invariant check: replicas that start late keep their offset forever, so
    gossip stalls far from consensus while the correct start reaches it."""
    correct = consensus("low_precision_decentralized", check_replicas=False)
    late = consensus(broken.LateInitLowPrecision(), check_replicas=False)
    assert correct < 1e-4 and late > 1e-2, (correct, late)
