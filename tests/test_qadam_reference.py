"""qadam against a single-process reference of the same math, in float64: two param
groups with different betas and weight decay (each parameter must follow its own group's),
before and after the warm-up and without one. The algorithm runs on its exact averaging
path (hierarchical, all ranks on one node: a full-precision reduce), so the reference can
be exact; silent and dropped-bucket variants must be rejected by the same check."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import require

torch = pytest.importorskip("torch")
require("sklearn")

import broken_algorithms as broken  # noqa: E402
import commlib  # noqa: E402
from algo_harness import gathered, param_groups  # noqa: E402
from commlib.algorithms.qadam import QAdamOptimizer  # noqa: E402
from test_algorithm_invariants import (  # noqa: E402
    assert_close,
    assert_rejected,
    flat,
    local_gradients,
    run,
    world,
)

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")


class QAdamReference:
    """Single-process qadam on float64 tensors (one list entry per parameter): warm-up
    steps are Adam on the mean gradient; then the variance is frozen and the momentum
    ``m = mean_r clamp((beta1 m + (1 - beta1)(g_r + wd p)) / denom) * denom`` is exact
    (the test runs the algorithm on its exact averaging path)."""

    def __init__(self, params, groups, warmup, max_update=10.0):
        self.p = [q.detach().clone() for q in params]
        self.groups, self.warmup, self.max_update = groups, warmup, max_update
        self.m = [torch.zeros_like(q) for q in self.p]
        self.v = [torch.zeros_like(q) for q in self.p]
        self.denom = None
        self.t = 0

    def step(self, local_grads):
        """``local_grads[r][i]``: rank r's gradient of parameter i."""
        n = len(local_grads)
        if self.t == self.warmup:
            self.denom = []
            for i, q in enumerate(self.p):
                g = self.groups[i]
                v_hat = self.v[i] / (1 - g["betas"][1] ** self.t) if self.t else None
                if v_hat is None:
                    self.denom.append(torch.ones_like(q) + g["eps"])
                else:
                    floor = g["variance_floor"] * v_hat.mean()
                    self.denom.append(v_hat.clamp(min=float(floor)).sqrt() + g["eps"])
        self.t += 1
        for i, q in enumerate(self.p):
            g = self.groups[i]
            b1, b2 = g["betas"]
            wd = g["weight_decay"]
            if self.denom is None:
                grad = sum(local_grads[r][i] for r in range(n)) / n + wd * q
                self.m[i] = b1 * self.m[i] + (1 - b1) * grad
                self.v[i] = b2 * self.v[i] + (1 - b2) * grad * grad
                denom = (self.v[i] / (1 - b2 ** self.t)).sqrt() + g["eps"]
            else:
                u = [((b1 * self.m[i] + (1 - b1) * (local_grads[r][i] + wd * q))
                      / self.denom[i]).clamp(-self.max_update, self.max_update)
                     for r in range(n)]
                self.m[i] = sum(u) / n * self.denom[i]
                denom = self.denom[i]
            self.p[i] = q - g["lr"] / (1 - b1 ** self.t) * self.m[i] / denom


GROUP_DEFAULTS = dict(lr=0.01, eps=1e-8, variance_floor=1e-4)


def qadam_groups(module):
    weights, biases = param_groups(module, weight_decay=0.05)
    weights.update(betas=(0.9, 0.999))
    biases.update(betas=(0.5, 0.9))
    return [weights, biases]


def qadam_check_run(algorithm, warmup=3, steps=7):
    """Train qadam's exact path (hierarchical, one node) against the reference."""
    rank, n = world()
    state = {}

    def optimizer(ddp):
        opt = QAdamOptimizer(qadam_groups(ddp.module), **GROUP_DEFAULTS)
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        state["ref"] = QAdamReference(list(ddp.module.parameters()),
                                      [group_of[id(p)] for p in ddp.module.parameters()],
                                      warmup)
        return opt

    def after_backward(ddp, step, x, y):
        local = gathered(local_gradients(ddp.module, x, y))
        shapes = [p.shape for p in ddp.module.parameters()]
        grads = [[torch.from_numpy(row[o:o + s.numel()]).view(s)
                  for o, s in zip(np.cumsum([0] + [s.numel() for s in shapes])[:-1], shapes)]
                 for row in local]
        state["ref"].step(grads)

    def after_step(ddp, step, x, y):
        ref = state["ref"]
        assert_close(flat(ddp.module.parameters()), flat(ref.p), 1e-10,
                     f"step {step}: parameters vs the reference")
        if step >= warmup:
            exp_avg = [ddp._qadam_opt.state[p]["exp_avg"] for p in ddp.module.parameters()]
            assert_close(flat(exp_avg), flat(ref.m), 1e-10, f"step {step}: momentum")

    def make_optimizer(ddp):
        ddp._qadam_opt = optimizer(ddp)
        return ddp._qadam_opt

    previous = commlib.options.local_size
    commlib.options.local_size = n  # one node: the hierarchical path averages exactly
    try:
        run(algorithm, steps=steps, optimizer=make_optimizer, after_backward=after_backward,
            after_step=after_step)
    finally:
        commlib.options.local_size = previous


@pytest.mark.mpi
@pytest.mark.parametrize("warmup", [3, 0])
def test_qadam_uses_each_parameters_own_group(warmup):
    """Biases (betas (0.5, 0.9), no weight decay) and weights (betas (0.9, 0.999), weight
    decay 0.05) each follow their own group's math, before and after the warm-up."""
    kw = dict(warmup_steps=warmup, hierarchical=True)
    qadam_check_run(commlib.algorithms.get("qadam", **kw), warmup=warmup)
    assert_rejected(lambda a: qadam_check_run(a, warmup=warmup),
                    broken.SilentQAdam(**kw), broken.DropBucketQAdam(**kw))
