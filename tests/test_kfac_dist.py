"""d_kfac and dp_kfac at any world size against single-process K-FAC (the reference of
test_kfac_math), with shards made deliberately different (inputs scaled by 1 + rank / 2).

* d_kfac == K-FAC on the whole batch;
* dp_kfac == per layer, K-FAC built from the owner's shard alone, applied to the global
  mean gradient (and != the whole-batch preconditioner, which a hidden factor allreduce
  would give);
* every rank ends every step with bitwise identical gradients and parameters;
* the bytes handed to MPI per step are exactly the spec's.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import commlib  # noqa: E402
from commlib.algorithms.kfac import DKFAC, DPKFAC  # noqa: E402
from commlib.algorithms.kfac.factors import update_running  # noqa: E402
from models import MLP, SmallCNN  # noqa: E402
from test_kfac_math import (  # noqa: E402
    ReferenceKFAC,
    grad_matrix,
    kfac_modules,
    reference_factors,
    set_grad_matrix,
)

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")

D = torch.float64
LR = 0.05


class Mixed(nn.Module):
    """Layers without bias, and layers K-FAC passes through (grouped conv, layer norm)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, bias=False)
        self.grouped = nn.Conv2d(4, 4, 3, groups=2)
        self.norm = nn.LayerNorm(16)
        self.fc1 = nn.Linear(16, 8, bias=False)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        x = torch.tanh(self.grouped(torch.tanh(self.conv(x))))
        return self.fc2(torch.tanh(self.fc1(self.norm(x.flatten(1)))))


# name: (constructor, input shape of one example, classes); a narrow MLP keeps the reference's
# dense Kronecker solves small
MODELS = {"mlp": (lambda: MLP(hidden=12), (10,), 4), "cnn": (SmallCNN, (1, 8, 8), 10),
          "mixed": (Mixed, (2, 6, 6), 3)}



def build(name):
    torch.manual_seed(11)
    return MODELS[name][0]().to(D)


def shard(name, step, rank, per_rank=4):
    """Rank ``rank``'s batch at ``step``; every rank can compute every shard."""
    _, shape, classes = MODELS[name]
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(per_rank, *shape, generator=g, dtype=D) * (1 + rank / 2)
    return x, torch.randint(0, classes, (per_rank,), generator=g)


def assert_close(actual, expected, what):
    """Within 1e-8, relative to each element and to the tensor's largest element (values of
    one preconditioned gradient span many orders of magnitude)."""
    torch.testing.assert_close(actual, expected, rtol=1e-8,
                               atol=1e-8 * float(expected.abs().max()),
                               msg=lambda m: f"{what}: {m}")


def world():
    return commlib.get_rank(), commlib.get_world_size()


def assert_identical_on_every_rank(tensors, what):
    mine = torch.cat([t.detach().reshape(-1) for t in tensors]).numpy()
    for r, other in enumerate(commlib.allgather(mine)):
        assert np.array_equal(other, mine), f"{what} of rank {r} differ from this rank's"


def reference_step(ref, ref_kfac, step, shards, owners):
    """One reference step: factors (whole batch, or per layer its owner's shard), the global
    mean gradient, preconditioned in place. Returns the KL scale used."""
    x, y = torch.cat([s[0] for s in shards]), torch.cat([s[1] for s in shards])
    if step % ref_kfac.f_steps == 0:
        if owners is None:
            factors = reference_factors(ref, x, y, F.cross_entropy)
        else:
            per_shard = [reference_factors(ref, *s, F.cross_entropy) for s in shards]
            factors = {k: per_shard[r][k] for k, r in owners.items()}
        ref_kfac.update(step, factors)
    else:
        ref_kfac.update(step, {})
    F.cross_entropy(ref(x), y).backward()
    mods = dict(kfac_modules(ref))
    pre = ref_kfac.precondition({k: grad_matrix(m) for k, m in mods.items()})
    for k, v in pre.items():
        set_grad_matrix(mods[k], v)


def train_against_reference(algorithm, name, steps=4, cls=None, **hp):
    """Train the same model with DDP (this rank's shard) and with the reference (all
    shards); after every backward and every step compare gradients and parameters with the
    reference and across ranks. Buckets are small: gradients and d_kfac's factors span
    several. ``cls``: an algorithm class to use instead of the registered one (negative
    controls). Returns the DDP wrapper (closed) and the reference."""
    rank, n = world()
    hp.setdefault("lr", LR)
    # Shards of 4 examples give singular factors; with the default damping (1e-3) unclipped
    # K-FAC steps are so large that the trajectory is chaotic and rounding differences
    # between two exact implementations grow past 1e-8 within a few steps.
    hp.setdefault("damping", 0.01)
    algo = commlib.algorithms.get(algorithm, **hp) if cls is None else cls(**hp)
    ddp = commlib.DistributedDataParallel(build(name), algorithm=algo, bucket_cap_mb=0.001)
    assert len(ddp._ctx.buckets) >= 3
    ref, ref_kfac = build(name), ReferenceKFAC(**hp)
    owners = ddp.algorithm.owners() if algorithm == "dp_kfac" else None
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    scales = []
    try:
        for step in range(steps):
            shards = [shard(name, step, r) for r in range(n)]
            opt.zero_grad()
            F.cross_entropy(ddp(shards[rank][0]), shards[rank][1]).backward()
            ref_opt.zero_grad()
            reference_step(ref, ref_kfac, step, shards, owners)
            scales.append(ref_kfac.last_scale)
            for (pname, a), b in zip(ddp.module.named_parameters(), ref.parameters()):
                assert_close(a.grad, b.grad, f"step {step} grad {pname}")
            assert_identical_on_every_rank([p.grad for p in ddp.parameters()], "gradients")
            opt.step()
            ref_opt.step()
            for (pname, a), b in zip(ddp.module.named_parameters(), ref.parameters()):
                assert_close(a.detach(), b.detach(), f"step {step} {pname}")
            assert_identical_on_every_rank(list(ddp.parameters()), "parameters")
    finally:
        ddp.close()
    return ddp, ref_kfac, scales


# -- parity ------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("name", ["mlp", "cnn", "mixed"])
@pytest.mark.parametrize("algorithm", ["d_kfac", "dp_kfac"])
def test_parity_with_single_process_kfac(algorithm, name):
    _, _, scales = train_against_reference(algorithm, name, kl_clip=None)
    assert scales == [1.0] * len(scales)


class _SilentKFAC:
    """Negative controls: K-FAC whose gradients are never averaged (each rank
    preconditions its own), and d_kfac whose factors are never averaged."""

    @staticmethod
    def gradients(base):
        class Silent(base):
            def on_bucket_ready(self, ctx, bucket):
                return None
        return Silent

    @staticmethod
    def local_factors():
        class LocalFactors(DKFAC):
            def _update_factors(self, ctx, first):
                for bucket in self._buckets:
                    for name, view in zip(bucket.names, bucket.views):
                        index, which = name.split(".")
                        fresh = self._capture.batch_factor(self._layers[int(index)], which)
                        update_running(view, fresh, self.factor_decay, first)
        return LocalFactors


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["d_kfac", "dp_kfac"])
def test_parity_check_rejects_broken_variants(algorithm):
    """The parity check above fails for K-FAC that never averages gradients, and for
    d_kfac that never averages its factors (both would still train)."""
    base = DKFAC if algorithm == "d_kfac" else DPKFAC
    controls = [_SilentKFAC.gradients(base)]
    if algorithm == "d_kfac":
        controls.append(_SilentKFAC.local_factors())
    for cls in controls:
        with pytest.raises(AssertionError):
            train_against_reference(algorithm, "mlp", kl_clip=None, cls=cls)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["d_kfac", "dp_kfac"])
def test_parity_with_binding_kl_clip(algorithm):
    _, _, scales = train_against_reference(algorithm, "cnn", kl_clip=1e-4, lr=0.5)
    assert min(scales) < 0.5  # the clip really scaled the steps


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["d_kfac", "dp_kfac"])
def test_parity_with_update_intervals_cholesky_and_round_robin(algorithm):
    train_against_reference(algorithm, "mixed", steps=6, factor_update_steps=2,
                            inv_update_steps=3, factor_decay=0.7, damping=0.01,
                            inverse="cholesky", assignment="round_robin")


@pytest.mark.mpi(min_size=2)
def test_dp_kfac_is_not_the_global_batch_preconditioner():
    """With shards of different statistics, the owner-shard preconditioner differs from the
    whole-batch one: a hidden factor allreduce in dp_kfac would make them equal."""
    rank, n = world()
    ddp = commlib.DistributedDataParallel(build("mlp"), algorithm="dp_kfac", kl_clip=None)
    ref = build("mlp")
    try:
        shards = [shard("mlp", 0, r) for r in range(n)]
        F.cross_entropy(ddp(shards[rank][0]), shards[rank][1]).backward()
        reference_step(ref, ReferenceKFAC(kl_clip=None), 0, shards, owners=None)
        for (pname, mine), (_, glob) in zip(kfac_modules(ddp.module), kfac_modules(ref)):
            diff = (grad_matrix(mine) - grad_matrix(glob)).norm() / grad_matrix(glob).norm()
            assert diff > 1e-3, f"{pname}: dp_kfac used the global-batch factors"
    finally:
        ddp.close()


# -- state: factors, inverses, owners, memory ---------------------------------------------
def _first_step(algorithm, name="cnn", **hp):
    rank, _ = world()
    ddp = commlib.DistributedDataParallel(build(name), algorithm=algorithm, **hp)
    x, y = shard(name, 0, rank)
    F.cross_entropy(ddp(x), y).backward()
    return ddp


@pytest.mark.mpi
def test_dp_kfac_owners_hold_their_shard_factors_and_nobody_else_holds_any():
    rank, n = world()
    ddp = _first_step("dp_kfac")
    try:
        algo = ddp.algorithm
        mine = {k for k, r in algo.owners().items() if r == rank}
        assert set(algo.held_factors()) == mine and set(algo.held_inverses()) == mine
        expected = reference_factors(build("cnn"), *shard("cnn", 0, rank), F.cross_entropy)
        for k, (A, G) in algo.held_factors().items():
            torch.testing.assert_close(A, expected[k][0], rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(G, expected[k][1], rtol=1e-12, atol=1e-14)
        d_in_out = algo.layer_shapes()
        assert algo.memory_breakdown()["factors"] == \
            8 * sum(d_in_out[k][0] ** 2 + d_in_out[k][1] ** 2 for k in mine)
    finally:
        ddp.close()


@pytest.mark.mpi
def test_d_kfac_every_rank_holds_the_global_batch_factors_and_every_inverse():
    _, n = world()
    ddp = _first_step("d_kfac")
    try:
        algo = ddp.algorithm
        shards = [shard("cnn", 0, r) for r in range(n)]
        x, y = torch.cat([s[0] for s in shards]), torch.cat([s[1] for s in shards])
        expected = reference_factors(build("cnn"), x, y, F.cross_entropy)
        assert set(algo.held_factors()) == set(expected) == set(algo.held_inverses())
        for k, (A, G) in algo.held_factors().items():
            torch.testing.assert_close(A, expected[k][0], rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(G, expected[k][1], rtol=1e-12, atol=1e-14)
        assert_identical_on_every_rank([t for ag in algo.held_factors().values() for t in ag],
                                       "factors")
    finally:
        ddp.close()


@pytest.mark.mpi
@pytest.mark.parametrize("method", ["greedy", "round_robin"])
def test_owners_are_the_same_everywhere_and_balanced(method):
    rank, n = world()
    ddp = commlib.DistributedDataParallel(build("mixed"), algorithm="dp_kfac", assignment=method)
    try:
        owners = ddp.algorithm.owners()
        assert list(owners) == ["conv", "fc1", "fc2"]  # module order, pass-through excluded
        everyone = commlib.allgather(np.array(list(owners.values())))
        assert all(np.array_equal(o, everyone[0]) for o in everyone)
        if method == "round_robin":
            assert list(owners.values()) == [i % n for i in range(3)]
        else:  # conv (19^3+4^3) is the most expensive: rank 0; the rest by load
            assert owners["conv"] == 0 and len(set(owners.values())) == min(n, 3)
    finally:
        ddp.close()


@pytest.mark.mpi(min_size=2)
def test_dp_kfac_holds_less_second_order_state_than_d_kfac():
    d, dp = _first_step("d_kfac"), _first_step("dp_kfac")
    try:
        for key in ("factors", "batch_factors", "inverses"):
            assert dp.algorithm.memory_breakdown()[key] < d.algorithm.memory_breakdown()[key]
        assert dp.algorithm.second_order_bytes() < d.algorithm.second_order_bytes()
    finally:
        d.close()
        dp.close()


# -- bytes handed to MPI -----------------------------------------------------------------
@pytest.fixture
def mpi_calls(monkeypatch):
    """Every (op, bytes) commlib counts, in order, as it counts them."""
    import commlib.base.accounting as module
    original, log = module.record, []

    def record(op, nbytes, size):
        log.append((op, nbytes))
        original(op, nbytes, size)

    monkeypatch.setattr(module, "record", record)
    return log


def _shapes(model):
    """(d_in, d_out) of each K-FAC layer, computed from the modules, not the library."""
    out = {}
    for name, m in kfac_modules(model):
        out[name] = (m.weight[0].numel() + (m.bias is not None), m.weight.shape[0])
    return out


def _bus(op, nbytes, n):
    return {"allreduce": 2 * (n - 1) * nbytes // n, "allgather_v": (n - 1) * nbytes,
            "allgather": (n - 1) * nbytes}[op]


def _steps_with_log(algorithm, steps, log, **hp):
    """Yield (step, ops of that step, stats of that step, ddp) for a few training steps."""
    rank, n = world()
    ddp = commlib.DistributedDataParallel(build("mixed"), algorithm=algorithm, **hp)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    try:
        for step in range(steps):
            x, y = shard("mixed", step, rank)
            log.clear()
            commlib.stats(reset=True)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            yield step, list(log), commlib.stats(reset=True), ddp
    finally:
        ddp.close()


def _check_stats(ops, stats, n):
    for op in {o for o, _ in ops}:
        calls = [b for o, b in ops if o == op]
        assert stats[op]["calls"] == len(calls) and stats[op]["bytes"] == sum(calls)
        assert stats[op]["bus_bytes"] == sum(_bus(op, b, n) for b in calls)


@pytest.mark.mpi
def test_dp_kfac_bytes_per_step(mpi_calls):
    rank, n = world()
    model = build("mixed")
    params = 8 * sum(p.numel() for p in model.parameters())
    shapes = _shapes(model)
    for step, ops, stats, ddp in _steps_with_log("dp_kfac", 3, mpi_calls):
        owners = ddp.algorithm.owners()
        mine = 8 * sum(i * o for k, (i, o) in shapes.items() if owners[k] == rank)
        grads = [b for op, b in ops if op == "allreduce"]
        assert sum(grads) == params and len(grads) == len(ddp._ctx.buckets)
        assert [b for op, b in ops if op == "allgather_v"] == [mine]
        assert [b for op, b in ops if op == "allgather"] == [16]  # allgather_v's shapes
        assert {op for op, _ in ops} == {"allreduce", "allgather_v", "allgather"}
        _check_stats(ops, stats, n)
        everyone = commlib.allgather(np.array([mine]))
        assert int(np.sum(everyone)) == 8 * sum(i * o for i, o in shapes.values())


@pytest.mark.mpi
@pytest.mark.parametrize("inverse", ["eigen", "cholesky"])
def test_d_kfac_bytes_per_step(mpi_calls, inverse):
    rank, n = world()
    model = build("mixed")
    params = 8 * sum(p.numel() for p in model.parameters())
    shapes = _shapes(model)
    factors = 8 * sum(i * i + o * o for i, o in shapes.values())
    extra = 1 if inverse == "eigen" else 0  # eigenvalues travel with the eigenvectors
    for step, ops, stats, ddp in _steps_with_log("d_kfac", 6, mpi_calls, inverse=inverse,
                                                 factor_update_steps=2, inv_update_steps=3):
        owners = ddp.algorithm.owners()
        inv = 8 * sum(i * i + o * o + extra * (i + o)
                      for k, (i, o) in shapes.items() if owners[k] == rank)
        expected = params + (factors if step % 2 == 0 else 0)
        assert sum(b for op, b in ops if op == "allreduce") == expected
        assert [b for op, b in ops if op == "allgather_v"] == ([inv] if step % 3 == 0 else [])
        assert [b for op, b in ops if op == "allgather"] == ([16] if step % 3 == 0 else [])
        _check_stats(ops, stats, n)


@pytest.mark.mpi
def test_d_kfac_gradient_accumulation_averages_the_micro_batch_factors():
    """Two backward passes, the first under no_sync: the factors are the mean of the two
    micro-batches' factors and the preconditioned gradient is that of the summed gradient."""
    rank, n = world()
    hp = dict(kl_clip=None, damping=0.01)
    ddp = commlib.DistributedDataParallel(build("cnn"), algorithm="d_kfac", **hp)
    ref, ref_kfac = build("cnn"), ReferenceKFAC(**hp)
    try:
        micro = [[shard("cnn", k, r) for r in range(n)] for k in range(2)]
        with ddp.no_sync():
            F.cross_entropy(ddp(micro[0][rank][0]), micro[0][rank][1]).backward()
        F.cross_entropy(ddp(micro[1][rank][0]), micro[1][rank][1]).backward()
        whole = [(torch.cat([s[0] for s in m]), torch.cat([s[1] for s in m])) for m in micro]
        per_micro = [reference_factors(ref, x, y, F.cross_entropy) for x, y in whole]
        ref_kfac.update(0, {k: tuple((a[i] + b[i]) / 2 for i in range(2))
                            for (k, a), b in zip(per_micro[0].items(), per_micro[1].values())})
        for x, y in whole:
            F.cross_entropy(ref(x), y).backward()
        mods = dict(kfac_modules(ref))
        pre = ref_kfac.precondition({k: grad_matrix(m) for k, m in mods.items()})
        for k, m in kfac_modules(ddp.module):
            assert_close(grad_matrix(m), pre[k], f"grad {k}")
    finally:
        ddp.close()
