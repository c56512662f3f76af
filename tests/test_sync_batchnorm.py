"""commlib.nn.SyncBatchNorm against one process running torch's BatchNorm on the
concatenated global batch (float64, 1e-10): outputs, input gradients, weight and bias
gradients (summed over ranks) and running statistics, with equal, unequal and empty
per-rank batches; a negative control (per-rank statistics) must be rejected by the same
checker; under commlib's DDP (with no_sync) against the single-process reference; bytes
per layer and step in commlib.stats()."""
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import commlib  # noqa: E402
from commlib.nn import SyncBatchNorm  # noqa: E402

TOL = dict(rtol=1e-10, atol=1e-10)
C = 3


def sizes(kind, n):
    """Per-rank batch sizes of one step."""
    if kind == "equal":
        return [4] * n
    if kind == "unequal":
        return [1 + 2 * r for r in range(n)] if n > 1 else [3]  # one row on rank 0
    return [0 if r == n - 1 and n > 1 else 3 for r in range(n)]  # the last rank brings none


def global_batch(kind, n, step, spatial=(2, 3)):
    g = torch.Generator().manual_seed(100 * step + 7)
    total = sum(sizes(kind, n))
    x = torch.randn(total, C, *spatial, generator=g, dtype=torch.float64) * 2 + 0.5
    w = torch.randn(total, C, *spatial, generator=g, dtype=torch.float64)
    return x, w


def my_slice(kind, n, rank):
    s = sizes(kind, n)
    start = sum(s[:rank])
    return slice(start, start + s[rank])


def layers(cls_local, spatial, momentum=0.1):
    """(reference BatchNorm, layer under test), same random affine parameters."""
    ref = (nn.BatchNorm1d if len(spatial) < 2 else nn.BatchNorm2d)(C, momentum=momentum).double()
    ours = cls_local(momentum).double()
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        ref.weight.copy_(torch.rand(C, generator=g, dtype=torch.float64) + 0.5)
        ref.bias.copy_(torch.randn(C, generator=g, dtype=torch.float64))
        ours.weight.copy_(ref.weight)
        ours.bias.copy_(ref.bias)
    return ref, ours


def mismatches(kind, make, spatial=(2, 3), steps=2, momentum=0.1):
    """Train-mode steps of ``make(momentum)`` on this rank's slice and of BatchNorm on the
    global batch; the list of quantities that differ (empty: all agree on this rank)."""
    rank, n = commlib.get_rank(), commlib.get_world_size()
    ref, ours = layers(make, spatial, momentum)
    mine = my_slice(kind, n, rank)
    bad = []
    for step in range(steps):
        x, w = global_batch(kind, n, step, spatial)
        xr = x.clone().requires_grad_()
        xo = x[mine].clone().requires_grad_()
        ref.zero_grad()
        ours.zero_grad()
        out_ref = ref(xr)
        (out_ref * w).sum().backward()
        out = ours(xo)
        (out * w[mine]).sum().backward()
        grads = torch.cat([ours.weight.grad, ours.bias.grad]).numpy().copy()
        total = commlib.allreduce(grads)  # this rank's parts sum to the global gradients
        checks = {
            "output": (out.detach(), out_ref.detach()[mine]),
            "input grad": (xo.grad, xr.grad[mine]),
            "weight/bias grad": (torch.from_numpy(total),
                                 torch.cat([ref.weight.grad, ref.bias.grad])),
            "running_mean": (ours.running_mean, ref.running_mean),
            "running_var": (ours.running_var, ref.running_var),
            "num_batches_tracked": (ours.num_batches_tracked.double(),
                                    ref.num_batches_tracked.double()),
        }
        bad += [f"step {step} {name}" for name, (a, b) in checks.items()
                if a.shape != b.shape or not torch.allclose(a, b, **TOL)]
    # eval mode: local, no communication, running statistics as the reference's
    ours.eval()
    ref.eval()
    x, _ = global_batch(kind, n, 99, spatial)
    before = commlib.stats()
    if not torch.allclose(ours(x[mine]), ref(x[mine]), **TOL):
        bad.append("eval output")
    if commlib.stats() != before:
        bad.append("eval communicated")
    return bad


def sync_layer(momentum):
    return SyncBatchNorm(C, momentum=momentum)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["equal", "unequal", "empty"])
@pytest.mark.parametrize("spatial", [(2, 3), ()], ids=["NCHW", "NC"])
def test_matches_batchnorm_on_the_global_batch(kind, spatial):
    assert mismatches(kind, sync_layer, spatial) == []


@pytest.mark.mpi
def test_cumulative_average_and_subgroup():
    # momentum=None (cumulative average) over a process_group holding every rank
    import copy
    group = commlib.new_group()
    try:
        # a deep copy shares the group (communicators are not copied)
        assert mismatches("unequal", lambda m: copy.deepcopy(
            SyncBatchNorm(C, momentum=m, process_group=group)), momentum=None, steps=3) == []
    finally:
        group.free()


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["equal", "unequal"])
def test_negative_control_unsynced_statistics_are_rejected(kind):
    if commlib.get_world_size() == 1:
        pytest.skip("one rank: local statistics are the global ones")
    bad = mismatches(kind, lambda m: nn.BatchNorm2d(C, momentum=m))
    assert any("output" in b for b in bad) and any("running_var" in b for b in bad), bad


@pytest.mark.mpi
def test_bytes_per_layer_and_step():
    layer = SyncBatchNorm(C).double()
    x = torch.randn(2, C, 4, 4, dtype=torch.float64, requires_grad=True)
    commlib.stats(reset=True)
    layer(x).sum().backward()
    got = commlib.stats(reset=True)
    assert list(got) == ["allreduce"]
    assert got["allreduce"]["calls"] == 2
    assert got["allreduce"]["bytes"] == 8 * (2 * C + 1) + 16 * C
    n = commlib.get_world_size()
    assert got["allreduce"]["bus_bytes"] == (2 * (n - 1) * 8 * (2 * C + 1) // n
                                            + 2 * (n - 1) * 16 * C // n)


@pytest.mark.mpi
def test_too_few_values_raise_on_every_rank():
    layer = SyncBatchNorm(C)
    x = torch.randn(1 if commlib.get_rank() == 0 else 0, C)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        layer(x)


def test_constructor_and_conversion_follow_torch():
    import inspect
    theirs = inspect.signature(nn.SyncBatchNorm.__init__).parameters
    ours = inspect.signature(SyncBatchNorm.__init__).parameters
    assert list(ours) == list(theirs)
    with pytest.raises(TypeError, match="process_group"):
        SyncBatchNorm(C, process_group="world")
    with pytest.raises(ValueError, match="2D"):
        SyncBatchNorm(C)(torch.randn(C))
    model = nn.Sequential(nn.Conv2d(1, C, 3), nn.BatchNorm2d(C),
                          nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, affine=False)))
    model[1].running_mean.fill_(0.25)
    weight = model[1].weight
    converted = SyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(converted[1], SyncBatchNorm) and isinstance(converted[2][1], SyncBatchNorm)
    assert converted[1].weight is weight and float(converted[1].running_mean[0]) == 0.25
    assert converted[2][1].weight is None
    assert set(converted.state_dict()) == set(nn.Sequential(
        nn.Conv2d(1, C, 3), nn.BatchNorm2d(C),
        nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, affine=False))).state_dict())
    assert isinstance(commlib.nn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(2)),
                      SyncBatchNorm)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.conv = nn.Conv2d(2, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.fc = nn.Linear(C * 9, 2)

    def forward(self, x):
        return self.fc(torch.tanh(self.bn(self.conv(x))).flatten(1))


@pytest.mark.mpi
def test_under_ddp_with_no_sync_matches_single_process_training(one_thread_per_rank):
    rank, n = commlib.get_rank(), commlib.get_world_size()
    ref = Net().double()
    ddp = commlib.DistributedDataParallel(
        SyncBatchNorm.convert_sync_batchnorm(Net().double()), bucket_cap_mb=0.0001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    try:
        for step in range(2):
            opt.zero_grad()
            ref_opt.zero_grad()
            for micro in range(2):  # the first micro-batch accumulates under no_sync
                g = torch.Generator().manual_seed(10 * step + micro)
                per = [2 + r % 2 for r in range(n)]
                x = torch.randn(sum(per), 2, 3, 3, generator=g, dtype=torch.float64)
                w = torch.randn(sum(per), 2, generator=g, dtype=torch.float64)
                mine = slice(sum(per[:rank]), sum(per[:rank + 1]))
                (ref(x) * w).sum().div(n).backward()  # DDP averages the ranks' gradients
                if micro == 0:
                    with ddp.no_sync():
                        (ddp(x[mine]) * w[mine]).sum().backward()
                else:
                    (ddp(x[mine]) * w[mine]).sum().backward()
            opt.step()
            ref_opt.step()
            for (name, a), b in zip(ddp.module.state_dict().items(), ref.state_dict().values()):
                torch.testing.assert_close(a.double(), b.double(), **TOL,
                                           msg=lambda m: f"step {step} {name}: {m}")
    finally:
        ddp.close()
