"""Sub-groups and hierarchical allreduce (simulated nodes with COMMLIB_LOCAL_SIZE)."""
import numpy as np
import pytest

import commlib
from commlib import ReduceOp
from helpers import rank_data


@pytest.mark.mpi
def test_subgroup_of_even_ranks():
    rank, n = commlib.get_rank(), commlib.get_world_size()
    members = list(range(0, n, 2))[::-1]
    group = commlib.new_group(members)
    assert group.size == len(members)
    x = np.array([float(rank), 1.0])
    if rank in members:
        assert group.rank == members.index(rank)
        group.allreduce(x)
        np.testing.assert_array_equal(x, [sum(members), len(members)])
        out = group.allgather(np.array([rank]))
        np.testing.assert_array_equal(out[:, 0], members)
        b = np.array([float(rank)])
        group.broadcast(b, src=0)
        assert b[0] == members[0]
    else:
        assert not group.is_member and group.rank == -1
        with pytest.raises(commlib.CommError, match="not a member"):
            group.allreduce(x)
    commlib.barrier()


@pytest.mark.mpi
def test_new_group_rejects_bad_ranks():
    n = commlib.get_world_size()
    with pytest.raises(ValueError, match="duplicates"):
        commlib.new_group([0, 0])
    with pytest.raises(ValueError, match="not members"):
        commlib.new_group([n + 3])


@pytest.mark.mpi
@pytest.mark.parametrize("local_size", [1, 2, 3])
@pytest.mark.parametrize("async_op", [False, True])
def test_hierarchical_equals_flat(local_size, async_op, monkeypatch):
    rank, n = commlib.get_rank(), commlib.get_world_size()
    monkeypatch.setattr(commlib.options, "local_size", local_size)
    group = commlib.new_group(hierarchical=True)
    local, leaders = group.comm.node()
    assert local.size == min(local_size, n - (rank // local_size) * local_size)
    assert (leaders is not None) == (rank % local_size == 0)
    for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
        xs = [rank_data(r, 1001, "float64", seed=11) for r in range(n)]
        flat = xs[rank].copy()
        hier = xs[rank].copy()
        commlib.allreduce(flat, op=op)
        work = group.allreduce(hier, op=op, async_op=async_op)
        if async_op:
            work.wait()
        np.testing.assert_array_equal(hier, flat)


@pytest.mark.mpi(min_size=2)
def test_hierarchical_counts_component_collectives(monkeypatch):
    rank, n = commlib.get_rank(), commlib.get_world_size()
    monkeypatch.setattr(commlib.options, "local_size", 2)
    group = commlib.new_group()
    x = np.ones(256, dtype=np.float32)
    commlib.stats(reset=True)
    group.allreduce(x, hierarchical=True)
    s = commlib.stats(reset=True)
    np.testing.assert_array_equal(x, n)
    local = min(2, n - (rank // 2) * 2)
    if local > 1:
        assert s["reduce"]["bytes"] == 1024 and s["broadcast"]["bytes"] == 1024
    nodes = (n + 1) // 2
    if rank % 2 == 0 and nodes > 1:
        assert s["allreduce"]["bus_bytes"] == 2 * (nodes - 1) * 1024 // nodes
    else:
        assert "allreduce" not in s


@pytest.mark.mpi
def test_local_rank_and_size():
    lr, ls = commlib.get_local_rank(), commlib.get_local_size()
    assert 0 <= lr < ls <= commlib.get_world_size()


@pytest.mark.mpi
def test_freed_groups_release_their_communicators():
    # MPICH has 2048 communicator ids per process: without free this loop would run out.
    for _ in range(2500):
        group = commlib.new_group()
        group.free()
    assert group.comm is None
    with pytest.raises(commlib.CommError):
        group.allreduce(np.zeros(1))


def _agrees(result: np.ndarray, reference: np.ndarray) -> bool:
    """The float64 exactness check of the pipelined scheme: 1e-10 relative."""
    return bool(np.allclose(result, reference, rtol=1e-10, atol=1e-12))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("local_size", [2, 3])
def test_pipelined_hierarchical_matches_flat_float64(local_size, monkeypatch):
    """Buffers of at least 2 MiB take the chunked, overlapped hierarchical path
    (``allreduce._pipelined``); in float64 it equals the flat allreduce to 1e-10 on every
    rank, for numpy and torch, SUM and AVG, uneven nodes (3 ranks) included. Negative
    control: a chunking that leaves the last elements out is rejected by the same check."""
    import importlib

    import torch
    ar = importlib.import_module("commlib.primitives.allreduce")
    rank, n = commlib.get_rank(), commlib.get_world_size()
    monkeypatch.setattr(commlib.options, "local_size", local_size)
    group = commlib.new_group(hierarchical=True)
    calls = []
    real = ar._pipelined

    def spy(*args):
        calls.append(len(args[3]))
        return (yield from real(*args))
    monkeypatch.setattr(ar, "_pipelined", spy)
    numel = (3 << 20) // 8 + 5  # 3 MiB of float64: 3 chunks, the last one longer
    xs = [np.random.default_rng(100 + r).standard_normal(numel) for r in range(n)]
    for op in (ReduceOp.SUM, ReduceOp.AVG):
        flat = xs[rank].copy()
        commlib.allreduce(flat, op=op)
        hier = xs[rank].copy()
        group.allreduce(hier, op=op)
        assert _agrees(hier, flat), f"rank {rank} {op}"
        t = torch.tensor(xs[rank])
        group.allreduce(t, op=op, async_op=True).wait()
        assert _agrees(t.numpy(), flat), f"rank {rank} {op} torch"
    assert calls == [3] * 4  # some node has 2 ranks: every call took the pipeline

    # negative control: a broken chunking (drops the last 1000 elements) must be caught
    real_chunks = ar._chunks

    def broken(buf):
        chunks = real_chunks(buf)
        last = chunks[-1]
        chunks[-1] = [last[0][:-1000], last[1] - 1000, last[2]]
        return chunks
    monkeypatch.setattr(ar, "_chunks", broken)
    flat = xs[rank].copy()
    commlib.allreduce(flat)
    bad = xs[rank].copy()
    group.allreduce(bad)
    assert not _agrees(bad, flat), f"rank {rank}: the check missed a broken chunking"
    assert _agrees(bad[:-1000], flat[:-1000])
    commlib.barrier()
