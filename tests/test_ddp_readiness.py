"""Gradient readiness corner cases against a single-process reference (float64, 1e-10):
branches used only in an accumulation micro-batch, parameters used outside forward,
iterations counted once whatever the number of optimizers, sparse gradients, and what a
failed construction leaves behind."""
import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import commlib  # noqa: E402

TOL = dict(rtol=1e-10, atol=1e-10)


class Branchy(nn.Module):
    """An MLP with an optional side branch; several buckets at a tiny ``bucket_cap_mb``."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.side = nn.Linear(16, 3)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x, use_side=False):
        h = torch.relu(self.fc1(x))
        out = self.head(torch.relu(self.fc2(h)))
        return out + self.side(h) if use_side else out


def make():
    torch.manual_seed(3)
    return Branchy().double()


def data(step, per_rank=3):
    n = commlib.get_world_size()
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n * per_rank, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n * per_rank,), generator=g)
    r = commlib.get_rank()
    return x, y, slice(r * per_rank, (r + 1) * per_rank)


def grads(model):
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def assert_grads_equal(got, want):
    assert got.keys() == want.keys()
    for name in got:
        assert (got[name] is None) == (want[name] is None), name
        if got[name] is not None:
            torch.testing.assert_close(got[name], want[name], **TOL,
                                       msg=lambda m: f"{name}: {m}")


def identical_everywhere(tensors):
    mine = torch.cat([t.detach().reshape(-1) for t in tensors]).numpy()
    return all(np.array_equal(o, mine) for o in commlib.allgather(mine))


@pytest.mark.mpi
def test_branch_used_only_inside_no_sync_is_exchanged_with_find_unused():
    ddp = commlib.DistributedDataParallel(make(), bucket_cap_mb=0.0005,
                                          find_unused_parameters=True)
    ref = make()
    try:
        assert len(ddp._ctx.buckets) >= 3
        x1, y1, mine = data(0)
        x2, y2, _ = data(1)
        with ddp.no_sync():
            F.cross_entropy(ddp(x1[mine], use_side=True), y1[mine]).backward()
        F.cross_entropy(ddp(x2[mine]), y2[mine]).backward()
        (F.cross_entropy(ref(x1, use_side=True), y1) + F.cross_entropy(ref(x2), y2)).backward()
        assert_grads_equal(grads(ddp.module), grads(ref))
        assert identical_everywhere([p.grad for p in ddp.module.parameters()])
    finally:
        ddp.close()


@pytest.mark.mpi
def test_branch_used_only_inside_no_sync_raises_without_find_unused():
    ddp = commlib.DistributedDataParallel(make(), bucket_cap_mb=0.0005)
    try:
        x1, y1, mine = data(0)
        with ddp.no_sync():
            F.cross_entropy(ddp(x1[mine], use_side=True), y1[mine]).backward()
        with pytest.raises(RuntimeError, match=r"no gradient.*side\.weight"):
            F.cross_entropy(ddp(x1[mine]), y1[mine]).backward()
    finally:
        ddp.close()


@pytest.mark.mpi
def test_globally_unused_branch_keeps_none_and_stale_gradients():
    ddp = commlib.DistributedDataParallel(make(), bucket_cap_mb=0.0005,
                                          find_unused_parameters=True)
    try:
        x, y, mine = data(0)
        F.cross_entropy(ddp(x[mine]), y[mine]).backward()
        assert ddp.module.side.weight.grad is None
        # A stale gradient (no zero_grad) of a parameter no rank uses is left as it was.
        stale = torch.full_like(ddp.module.side.weight, float(commlib.get_rank()))
        ddp.module.side.weight.grad = stale.clone()
        F.cross_entropy(ddp(x[mine]), y[mine]).backward()
        torch.testing.assert_close(ddp.module.side.weight.grad, stale, **TOL)
    finally:
        ddp.close()


@pytest.mark.mpi
@pytest.mark.parametrize("on", ["all", "rank0"])
def test_gradient_after_marked_unused_raises_on_every_rank(on):
    ddp = commlib.DistributedDataParallel(make(), bucket_cap_mb=0.0005,
                                          find_unused_parameters=True)
    try:
        x, y, mine = data(0)
        loss = F.cross_entropy(ddp(x[mine]), y[mine])
        if on == "all" or commlib.get_rank() == 0:
            loss = loss + 1e-2 * ddp.module.side.weight.pow(2).sum()  # outside forward
        with pytest.raises(RuntimeError, match=r"rank 0: \['side\.weight'\].*outside forward"):
            loss.backward()
    finally:
        ddp.close()


@pytest.mark.mpi
def test_static_graph_allows_a_parameter_used_outside_forward():
    ddp = commlib.DistributedDataParallel(make(), bucket_cap_mb=0.0005, static_graph=True)
    ref = make()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    try:
        for step in range(3):
            x, y, mine = data(step)
            opt.zero_grad()
            ref_opt.zero_grad()
            (F.cross_entropy(ddp(x[mine]), y[mine])
             + 1e-2 * ddp.module.side.weight.pow(2).sum()).backward()
            (F.cross_entropy(ref(x), y) + 1e-2 * ref.side.weight.pow(2).sum()).backward()
            assert_grads_equal(grads(ddp.module), grads(ref))
            opt.step()
            ref_opt.step()
    finally:
        ddp.close()


@pytest.mark.mpi
def test_one_iteration_is_one_step_with_two_optimizers():
    ddp = commlib.DistributedDataParallel(make(), algorithm="local_sgd", sync_every=2)
    body = [p for n, p in ddp.module.named_parameters() if not n.startswith("head")]
    opts = [torch.optim.SGD(body, lr=0.1), torch.optim.SGD(ddp.module.head.parameters(), lr=0.1)]
    try:
        for step in range(3):
            x, y, mine = data(step)
            commlib.stats(reset=True)
            F.cross_entropy(ddp(x[mine]), y[mine]).backward()
            averaged = "allreduce" in commlib.stats()
            # The average after iteration 2 happens before iteration 3's forward, once.
            assert averaged == (step == 2), step
            for opt in opts:
                opt.step()
                opt.zero_grad()
            assert ddp._ctx.step == step + 1
            if step == 1 and commlib.get_world_size() > 1:
                assert not identical_everywhere(list(ddp.module.parameters()))
        ddp.average_parameters()
        assert identical_everywhere(list(ddp.module.parameters()))
    finally:
        ddp.close()


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm,kwargs", [("local_sgd", {"sync_every": 2}),
                                              ("decentralized", {"communication_interval": 2}),
                                              ("low_precision_decentralized",
                                               {"communication_interval": 2})])
def test_a_rank_skipping_optimizer_steps_keeps_schedules_in_step(algorithm, kwargs):
    """Rank 0 skips every other optimizer step (as GradScaler after an overflow seen only
    there); schedules count iterations, so every rank communicates at the same ones."""
    ddp = commlib.DistributedDataParallel(make(), algorithm=algorithm, **kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    try:
        for step in range(6):
            x, y, mine = data(step)
            opt.zero_grad()
            F.cross_entropy(ddp(x[mine]), y[mine]).backward()
            if not (commlib.get_rank() == 0 and step % 2):
                opt.step()
        steps = commlib.allgather(np.array([ddp._ctx.step]))
        assert (steps == 6).all()
        ddp.average_parameters()
        assert identical_everywhere(list(ddp.module.parameters()))
    finally:
        ddp.close()


@pytest.mark.mpi(min_size=2)
def test_checking_mode_reports_iterations_out_of_step(monkeypatch):
    """Rank 1 runs its backward under no_sync (no iteration ends there): the next forward
    names the disagreement on every rank instead of letting schedules drift."""
    monkeypatch.setattr(commlib.options, "check", True)
    ddp = commlib.DistributedDataParallel(make(), algorithm="local_sgd", sync_every=100)
    try:
        x, y, mine = data(0)
        with ddp.no_sync() if commlib.get_rank() == 1 else contextlib.nullcontext():
            F.cross_entropy(ddp(x[mine]), y[mine]).backward()
        with pytest.raises(commlib.CommError, match=r"disagree.*iteration\(step=\d\)"):
            ddp(x[mine])
    finally:
        ddp.close()


@pytest.mark.mpi
def test_sparse_embedding_is_refused_naming_the_parameter():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"'0\.weight'.*sparse=False"):
        commlib.DistributedDataParallel(model)


@pytest.mark.mpi(min_size=2)
def test_failed_construction_frees_its_communicator(monkeypatch):
    freed = []
    original = commlib.Group.free
    monkeypatch.setattr(commlib.Group, "free", lambda self: (freed.append(self),
                                                             original(self)))
    model = Branchy() if commlib.get_rank() == 0 else nn.Linear(3, 3)
    with pytest.raises(commlib.CommError, match="different models"):
        commlib.DistributedDataParallel(model)
    assert len(freed) == 1 and freed[0].comm is None


@pytest.mark.mpi
def test_construction_and_averaging_move_bounded_buffers(monkeypatch):
    from commlib.ddp import wrapper
    sizes = []
    for name in ("broadcast", "allreduce"):
        original = getattr(wrapper, name)
        monkeypatch.setattr(wrapper, name, lambda flat, *a, _f=original: (
            sizes.append(flat.numel()), _f(flat, *a))[1])
    monkeypatch.setattr(wrapper, "COALESCE_BYTES", 16 * 16 * 8)
    torch.manual_seed(commlib.get_rank())
    model = Branchy().double()
    ddp = commlib.DistributedDataParallel(model)
    try:
        assert identical_everywhere(list(model.parameters()))
        if commlib.get_world_size() > 1:
            assert sizes and max(sizes) <= 16 * 16, sizes
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(commlib.get_rank())
            sizes.clear()
            ddp.average_parameters()
            assert identical_everywhere(list(model.parameters()))
            assert len(sizes) > 1 and max(sizes) <= 16 * 16, sizes
    finally:
        ddp.close()
