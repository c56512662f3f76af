"""commlib.DistributedDataParallel with gradient_allreduce against single-process training
on the whole batch, at any world size: each rank trains on its slice of every batch."""
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import commlib  # noqa: E402
from models import MLP, batch, make  # noqa: E402

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def world():
    return commlib.get_rank(), commlib.get_world_size()


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def assert_identical_everywhere(model):
    mine = flat_params(model).double().numpy()
    everyone = commlib.allgather(mine)
    for other in everyone:
        np.testing.assert_array_equal(other, mine)


def train_pair(name, dtype, steps=10, per_rank=4, bucket_cap_mb=25.0, find_unused=False,
               model_kw=None, **ddp_kw):
    """Train the same model with DDP (this rank's slice) and alone (the whole batch);
    compare parameters after every step."""
    rank, n = world()
    model_kw = model_kw or {}
    ref = make(name, dtype, **model_kw)
    ddp = commlib.DistributedDataParallel(make(name, dtype, **model_kw),
                                          bucket_cap_mb=bucket_cap_mb,
                                          find_unused_parameters=find_unused, **ddp_kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    try:
        for step in range(steps):
            x, y = batch(name, n, per_rank, dtype, step)
            mine = slice(rank * per_rank, (rank + 1) * per_rank)
            opt.zero_grad()
            F.cross_entropy(ddp(x[mine]), y[mine]).backward()
            opt.step()
            ref_opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            ref_opt.step()
            for (pname, a), b in zip(ddp.module.named_parameters(), ref.parameters()):
                assert (a.grad is None) == (b.grad is None), pname
                torch.testing.assert_close(a, b, rtol=TOL[dtype], atol=TOL[dtype],
                                           msg=lambda m: f"step {step} {pname}: {m}")
        assert_identical_everywhere(ddp.module)
        return ddp
    finally:
        ddp.close()


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_parity_default_buckets(name, dtype):
    train_pair(name, dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_parity_buckets_cut_through_the_model(name):
    ddp = train_pair(name, torch.float64, bucket_cap_mb=0.0005)
    assert len(ddp._ctx.buckets) > 3


@pytest.mark.mpi
def test_parity_with_a_parameter_that_gets_no_gradient():
    ddp = train_pair("mlp", torch.float64, find_unused=True, bucket_cap_mb=0.001,
                     model_kw={"unused": True})
    assert ddp.module.unused.weight.grad is None


@pytest.mark.mpi
@pytest.mark.parametrize("local_size", [2])
def test_parity_hierarchical(local_size, monkeypatch):
    monkeypatch.setattr(commlib.options, "local_size", local_size)
    train_pair("mlp", torch.float64, algorithm="gradient_allreduce", hierarchical=True,
               bucket_cap_mb=0.001)


@pytest.mark.mpi
def test_missing_gradient_without_find_unused_says_what_to_do():
    ddp = commlib.DistributedDataParallel(MLP(unused=True).double())
    try:
        loss = ddp(torch.randn(2, 10, dtype=torch.float64)).sum()
        with pytest.raises(RuntimeError, match="find_unused_parameters=True"):
            loss.backward()
    finally:
        ddp.close()


@pytest.mark.mpi
def test_no_sync_accumulates_like_one_step_on_the_summed_gradient():
    rank, n = world()
    dtype = torch.float64
    ddp = commlib.DistributedDataParallel(make("mlp", dtype), bucket_cap_mb=0.001)
    ref = make("mlp", dtype)
    x1, y1 = batch("mlp", n, 3, dtype, step=0)
    x2, y2 = batch("mlp", n, 3, dtype, step=1)
    mine = slice(rank * 3, (rank + 1) * 3)
    try:
        with ddp.no_sync():
            F.cross_entropy(ddp(x1[mine]), y1[mine]).backward()
        assert commlib.stats()  # counters exist; the exchange happens on the next backward
        F.cross_entropy(ddp(x2[mine]), y2[mine]).backward()
        (F.cross_entropy(ref(x1), y1) + F.cross_entropy(ref(x2), y2)).backward()
        for a, b in zip(ddp.module.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-10)
    finally:
        ddp.close()


@pytest.mark.mpi
def test_close_releases_the_communicator():
    ddp = commlib.DistributedDataParallel(make("mlp", torch.float64))
    ddp.close()
    assert ddp.process_group.comm is None
    ddp.close()  # idempotent


@pytest.mark.mpi
def test_no_sync_makes_no_collective():
    ddp = commlib.DistributedDataParallel(make("mlp", torch.float64))
    try:
        commlib.stats(reset=True)
        with ddp.no_sync():
            ddp(torch.randn(2, 10, dtype=torch.float64)).sum().backward()
        assert "allreduce" not in commlib.stats()
    finally:
        ddp.close()


@pytest.mark.mpi(min_size=2)
def test_mismatched_models_raise_at_construction():
    rank, _ = world()
    model = MLP(hidden=32 if rank == 0 else 33)
    with pytest.raises(commlib.CommError, match="ranks wrap different models.*fc1.weight"):
        commlib.DistributedDataParallel(model)


@pytest.mark.mpi(min_size=2)
def test_construction_broadcasts_parameters_and_buffers_from_rank_0():
    rank, _ = world()
    torch.manual_seed(100 + rank)
    model = make("cnn", torch.float32, seed=100 + rank, bn=True)
    model.bn.running_mean.fill_(rank)
    ddp = commlib.DistributedDataParallel(model)
    try:
        assert_identical_everywhere(model)
        assert float(model.bn.running_mean[0]) == 0.0
    finally:
        ddp.close()


@pytest.mark.mpi
def test_state_dict_loads_into_a_plain_model_and_saves():
    ddp = commlib.DistributedDataParallel(make("cnn", torch.float32))
    try:
        plain = make("cnn", torch.float32, seed=99)
        plain.load_state_dict(ddp.module.state_dict())
        x = torch.randn(3, 1, 8, 8)
        ddp.eval()
        plain.eval()
        torch.testing.assert_close(ddp(x), plain(x))
        if commlib.get_rank() == 0:
            buffer = io.BytesIO()
            torch.save(ddp.module.state_dict(), buffer)
            buffer.seek(0)
            plain.load_state_dict(torch.load(buffer))
    finally:
        ddp.close()


@pytest.mark.mpi
def test_algorithm_hooks_are_called_in_order():
    calls = []

    class Recorder(commlib.algorithms.get("gradient_allreduce").__class__):
        def before_forward(self, ctx):
            calls.append("forward")

        def after_backward(self, ctx):
            calls.append("backward")

        def before_optimizer_step(self, ctx, optimizer):
            calls.append("pre_step")

        def after_optimizer_step(self, ctx, optimizer):
            calls.append(f"post_step{ctx.step}")

    ddp = commlib.DistributedDataParallel(make("mlp", torch.float64), algorithm=Recorder())
    opt = torch.optim.Adam(ddp.parameters())
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    try:
        for _ in range(2):
            ddp(torch.randn(2, 10, dtype=torch.float64)).sum().backward()
            opt.step()
            other.step()  # not an optimizer of the wrapped module: not observed
        assert calls == ["forward", "backward", "pre_step", "post_step1"] * 1 + \
            ["forward", "backward", "pre_step", "post_step2"]
    finally:
        ddp.close()


@pytest.mark.mpi
def test_a_dropped_wrapper_is_freed_and_closed_without_the_garbage_collector():
    """No reference cycle keeps a wrapper alive: ``del ddp`` closes it at once (its thread
    and communicator released then, not at interpreter exit)."""
    import gc
    import weakref
    gc.disable()
    try:
        ddp = commlib.DistributedDataParallel(make("mlp", torch.float64))
        ddp(torch.randn(2, 10, dtype=torch.float64)).sum().backward()
        group = ddp.process_group
        ref = weakref.ref(ddp)
        del ddp
        assert ref() is None
        assert group.comm is None
    finally:
        gc.enable()
