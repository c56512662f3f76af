"""Differential tests: torch's own DistributedDataParallel and ZeroRedundancyOptimizer over
the commlib backend against the same over gloo, in one job, on the same float64 model and
data; a deliberately broken backend must make the comparison fail. (DistributedSampler over
the default group of the commlib backend runs in test_torch_launch.py's programs.)"""
import numpy as np
import pytest

import commlib

torch = pytest.importorskip("torch")
dist = torch.distributed
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
STEPS = 12
TOL = 1e-10


def model() -> "torch.nn.Module":
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4)).double()


def train(pg, zero: bool = False, steps: int = STEPS) -> list[np.ndarray]:
    """Parameters (flattened) after each step of torch DDP over ``pg``; several small
    buckets; each rank's batches differ. ``zero``: ZeroRedundancyOptimizer (Adam) over
    ``pg`` instead of SGD with momentum."""
    net = DDP(model(), process_group=pg, bucket_cap_mb=0.002)
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam,
                                      process_group=pg, lr=1e-2)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    snapshots = []
    for _ in range(steps):
        x = torch.randn(5, 8, generator=g, dtype=torch.float64)
        y = torch.randn(5, 4, generator=g, dtype=torch.float64)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        snapshots.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy()
                         .copy())
    return snapshots


def max_differences(a: list, b: list) -> list[float]:
    """Per step, the largest difference between two runs, maximum over ranks."""
    mine = np.array([np.abs(x - y).max() for x, y in zip(a, b)])
    return commlib.allreduce(mine, op="max").tolist()


@pytest.mark.mpi
@pytest.mark.parametrize("zero", [False, True], ids=["ddp", "zero"])
def test_commlib_backend_trains_like_gloo(torch_groups, zero):
    world, gloo = torch_groups
    ours, theirs = train(world, zero), train(gloo, zero)
    diffs = max_differences(ours, theirs)
    assert max(diffs) < TOL, f"commlib vs gloo, per step: {diffs}"
    assert np.abs(ours[-1] - ours[0]).max() > 1e-3  # it trained
    replicas = commlib.allgather(ours[-1])
    np.testing.assert_array_equal(replicas, np.broadcast_to(ours[-1], replicas.shape))


class _SilentAllreduce(commlib.torch_backend.ProcessGroupCommlib):
    """The negative control: an allreduce that does nothing."""

    def allreduce(self, tensors, opts=None):
        return commlib.torch_backend.CommlibWork(list(tensors))


def _broken(opts, _options=None):
    group = commlib.new_subgroup(list(opts.global_ranks_in_group))
    return _SilentAllreduce(group, opts.group_rank, opts.group_size)


@pytest.mark.mpi(min_size=2)
def test_differential_check_catches_a_broken_backend(torch_groups):
    world, gloo = torch_groups
    if "COMMLIB_BROKEN" not in dist.Backend._plugins:
        dist.Backend.register_backend("commlib_broken", _broken, extended_api=True,
                                      devices=["cpu"])
    broken = dist.new_group(backend="commlib_broken")
    diffs = max_differences(train(broken, steps=3), train(gloo, steps=3))
    assert max(diffs) > 1e-6, f"the comparison missed a backend that skips allreduce: {diffs}"
    dist.destroy_process_group(broken)


@pytest.mark.mpi
def test_distributed_sampler_and_objects_over_the_commlib_group(torch_groups):
    from torch.utils.data import DistributedSampler, TensorDataset
    world, _ = torch_groups
    r, n = world.rank(), world.size()
    dataset = TensorDataset(torch.arange(23))
    sampler = DistributedSampler(dataset, num_replicas=n, rank=r, seed=3)
    sampler.set_epoch(1)
    mine = list(sampler)
    assert len(mine) == -(-23 // n)
    everyone = [None] * n
    dist.all_gather_object(everyone, mine, group=world)
    assert everyone[r] == mine
    assert sorted(set(i for part in everyone for i in part)) == list(range(23))


class SparseNet(torch.nn.Module):
    """An embedding with sparse gradients (summed bags) feeding a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb = torch.nn.Embedding(20, 6, sparse=True).double()
        self.head = torch.nn.Linear(6, 2).double()

    def forward(self, ids: "torch.Tensor") -> "torch.Tensor":
        return self.head(self.emb(ids).sum(1))


def train_sparse(pg, steps: int = 6) -> list[np.ndarray]:
    """torch DDP over ``pg`` with nn.Embedding(sparse=True) (its gradient travels through
    a sparse all_reduce), SGD; parameters after each step; each rank's ids differ."""
    net = DDP(SparseNet(), process_group=pg)
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    g = torch.Generator().manual_seed(300 + dist.get_rank())
    snapshots = []
    for _ in range(steps):
        ids = torch.randint(0, 20, (4, 3), generator=g)
        y = torch.randn(4, 2, generator=g, dtype=torch.float64)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(ids), y).backward()
        assert net.module.emb.weight.grad.is_sparse
        opt.step()
        snapshots.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy()
                         .copy())
    return snapshots


@pytest.mark.mpi
def test_sparse_embedding_under_ddp_trains_like_gloo(torch_groups):
    world, gloo = torch_groups
    ours, theirs = train_sparse(world), train_sparse(gloo)
    diffs = max_differences(ours, theirs)
    assert max(diffs) < TOL, f"sparse DDP over commlib vs gloo, per step: {diffs}"
    replicas = commlib.allgather(ours[-1])
    np.testing.assert_array_equal(replicas, np.broadcast_to(ours[-1], replicas.shape))


@pytest.mark.mpi(min_size=2)
def test_sparse_comparison_catches_a_broken_backend(torch_groups):
    _, gloo = torch_groups
    if "COMMLIB_BROKEN" not in dist.Backend._plugins:
        dist.Backend.register_backend("commlib_broken", _broken, extended_api=True,
                                      devices=["cpu"])
    broken = dist.new_group(backend="commlib_broken")
    diffs = max_differences(train_sparse(broken, 3), train_sparse(gloo, 3))
    assert max(diffs) > 1e-6, f"the comparison missed a backend that skips allreduce: {diffs}"
    dist.destroy_process_group(broken)
