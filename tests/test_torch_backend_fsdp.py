"""torch's own FSDP2 (``fully_shard``) over the commlib backend against the same over gloo,
in one job, float64, after every step; and the in-place collectives it relies on.

FSDP2 all-gathers every parameter with ``all_gather_into_tensor`` whose input is this
rank's block of the output, and reduce-scatters into tensors that may be blocks of the
input: the in-place forms (MPICH refused them: "Buffers must not be aliased")."""
import numpy as np
import pytest

import commlib
from helpers import rank_data

torch = pytest.importorskip("torch")
dist = torch.distributed

STEPS = 4


def model() -> "torch.nn.Module":
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Tanh(),
                               torch.nn.Linear(24, 24), torch.nn.Tanh(),
                               torch.nn.Linear(24, 3)).double()


def train_fully_shard(pg, steps: int = STEPS) -> list[np.ndarray]:
    """This rank's parameter shards after each step of torch's ``fully_shard`` (each
    Linear, then the root) over process group ``pg``; each rank's batches differ."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    net = model()
    mesh = DeviceMesh.from_group(pg, "cpu")
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(200 + dist.get_rank())
    shards = []
    for _ in range(steps):
        x = torch.randn(6, 8, generator=g, dtype=torch.float64)
        y = torch.randn(6, 3, generator=g, dtype=torch.float64)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        shards.append(torch.cat([p.to_local().detach().reshape(-1)
                                 for p in net.parameters()]).numpy().copy())
    return shards


def max_differences(a: list, b: list) -> list[float]:
    """Per step, the largest difference, maximum over ranks (NaN counts as infinite)."""
    mine = np.array([np.abs(x - y).max() if x.size else 0.0 for x, y in zip(a, b)])
    return commlib.allreduce(np.nan_to_num(mine, nan=np.inf), op="max").tolist()


@pytest.mark.mpi
def test_fully_shard_over_commlib_trains_like_gloo(torch_groups):
    world, gloo = torch_groups
    ours, theirs = train_fully_shard(world), train_fully_shard(gloo)
    diffs = max_differences(ours, theirs)
    assert max(diffs) < 1e-12, f"fully_shard over commlib vs gloo, per step: {diffs}"
    moved = commlib.allreduce(np.array([np.abs(ours[-1] - ours[0]).max()]), op="max")
    assert moved[0] > 1e-3  # it trained


class _LazyAllGather(commlib.torch_backend.ProcessGroupCommlib):
    """The negative control: all_gather_into_tensor that fills in only this rank's block."""

    def all_gather_single(self, output, input, opts=None):
        n = input.numel()
        output.view(-1)[self.rank() * n:(self.rank() + 1) * n].copy_(input.reshape(-1))
        return commlib.torch_backend.CommlibWork([output])

    _allgather_base = all_gather_single


def _lazy(opts, _options=None):
    group = commlib.new_subgroup(list(opts.global_ranks_in_group))
    return _LazyAllGather(group, opts.group_rank, opts.group_size)


@pytest.mark.mpi(min_size=2)
def test_fully_shard_comparison_catches_a_broken_all_gather(torch_groups):
    world, gloo = torch_groups
    if "COMMLIB_LAZY" not in dist.Backend._plugins:
        dist.Backend.register_backend("commlib_lazy", _lazy, extended_api=True,
                                      devices=["cpu"])
    broken = dist.new_group(backend="commlib_lazy")
    diffs = max_differences(train_fully_shard(broken, 2), train_fully_shard(gloo, 2))
    assert max(diffs) > 1e-6, f"the comparison missed a broken all-gather: {diffs}"
    dist.destroy_process_group(broken)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_in_place_all_gather_and_reduce_scatter_tensor(torch_groups, mode):
    """The input is this rank's block of the output (all-gather), the output this rank's
    block of the input (reduce-scatter), on every rank; results equal gloo's."""
    world, gloo = torch_groups
    r, n = dist.get_rank(), dist.get_world_size()
    asynchronous = mode == "async"
    for numel in (1, 5, 33):
        results = []
        for pg in (world, gloo):
            out = torch.zeros(n * numel, dtype=torch.float64)
            out[r * numel:(r + 1) * numel] = torch.from_numpy(rank_data(r, numel, "float64"))
            work = dist.all_gather_into_tensor(out, out[r * numel:(r + 1) * numel],
                                               group=pg, async_op=asynchronous)
            if asynchronous:
                work.wait()
            big = torch.from_numpy(rank_data(r, n * numel, "float64", seed=1))
            mine = big[r * numel:(r + 1) * numel]
            work = dist.reduce_scatter_tensor(mine, big, group=pg, async_op=asynchronous)
            if asynchronous:
                work.wait()
            results.append((out.clone(), mine.clone()))
        expected = np.concatenate([rank_data(k, numel, "float64") for k in range(n)])
        np.testing.assert_array_equal(results[0][0].numpy(), expected)
        np.testing.assert_array_equal(results[0][0].numpy(), results[1][0].numpy())
        total = np.sum([rank_data(k, n * numel, "float64", seed=1) for k in range(n)], 0)
        np.testing.assert_array_equal(results[0][1].numpy(),
                                      total[r * numel:(r + 1) * numel])
        np.testing.assert_array_equal(results[0][1].numpy(), results[1][1].numpy())


@pytest.mark.mpi
def test_all_to_all_single_with_overlapping_buffers(commlib_pg):
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.from_numpy(rank_data(r, 3 * n, "float64", seed=2))
    dist.all_to_all_single(t, t, group=commlib_pg)            # output is the input
    expected = np.concatenate([rank_data(k, 3 * n, "float64", seed=2)[3 * r:3 * r + 3]
                               for k in range(n)])
    np.testing.assert_array_equal(t.numpy(), expected)
