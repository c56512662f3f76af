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
        calls.append(len(args[4]))  # (local, bcast, leaders, buf, chunks, mop)
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


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("local_size", [2, 3])
def test_async_hierarchical_any_wait_order(local_size, monkeypatch):
    """Async hierarchical allreduces of different sizes, waited (or polled) in an order that
    differs from the issue order and from rank to rank, each give the flat result: every
    stage of every operation starts in issue order on every rank (a rank alone on its node
    starts the leaders' allreduce at issue, the others only once their node reduce is
    done). The sizes include pipelined ones (>= 2 MiB). Negative control: the same check
    rejects the results when two ranks pass the buffers in different orders."""
    import itertools
    rank, n = commlib.get_rank(), commlib.get_world_size()
    monkeypatch.setattr(commlib.options, "local_size", local_size)
    group = commlib.new_group(hierarchical=True)
    sizes = [1001, 37, (5 << 20) // 8 + 3, 2, 4096]
    xs = [[np.random.default_rng(7 * r + k).standard_normal(s) for r in range(n)]
          for k, s in enumerate(sizes)]
    refs = [sum(x[r] for r in range(n)) for x in xs]
    orders = list(itertools.permutations(range(len(sizes))))
    rng = np.random.default_rng(5)
    for trial in range(12):
        # trial 0: every rank waits in reverse issue order; then each rank its own order
        pick = int(rng.integers(len(orders)))
        order = orders[-1] if trial == 0 else orders[(pick + 31 * rank) % len(orders)]
        bufs = [x[rank].copy() for x in xs]
        works = [group.allreduce(b, async_op=True) for b in bufs]
        if trial % 3 == 0:
            for _ in range(50):
                for k in order:
                    works[k].is_completed()
        for k in order:
            works[k].wait()
        for k, (b, ref) in enumerate(zip(bufs, refs)):
            assert _agrees(b, ref), f"rank {rank} trial {trial} buffer {k} (wait order {order})"

    # negative control: ranks issuing two same-sized buffers in different orders (what a
    # start order decided by the wait order amounts to) give results the check rejects
    a, b = xs[0][rank].copy(), xs[0][(rank + 1) % n].copy()
    first, second = (a, b) if rank == 0 else (b, a)
    w1, w2 = group.allreduce(first, async_op=True), group.allreduce(second, async_op=True)
    w2.wait()
    w1.wait()
    assert not _agrees(a, refs[0])


class _StartLog:
    """A proxy of an ``MPI.Comm`` that records the collectives started on it, in order."""

    def __init__(self, comm, log):
        self._comm, self._log = comm, log

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if callable(attr) and name[:1].isupper() and name not in ("Get_rank", "Get_size"):
            def logged(*args, **kwargs):
                self._log.append(name)
                return attr(*args, **kwargs)
            return logged
        return attr


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("local_size", [2, 3])
def test_blocking_compressed_hierarchical_after_pending_async(local_size, monkeypatch):
    """A blocking hierarchical compressed allreduce issued while async hierarchical
    allreduces of the same group are still pending shares their node and leader
    communicators: it starts its collectives there after theirs on every rank (MPI wants
    the same start order on every member; MPICH happens to keep blocking and nonblocking
    collectives apart, so the order is checked on a log of what each rank started), and
    all results are right."""
    from commlib.primitives import compressed_allreduce
    rank, n = commlib.get_rank(), commlib.get_world_size()
    monkeypatch.setattr(commlib.options, "local_size", local_size)
    group = commlib.new_group(hierarchical=True)
    local, leaders = group.comm.node()
    logs = {"local": [], "leaders": [], "bcast": []}
    bcast = group.comm.node_broadcast()
    for name, c in (("local", local), ("leaders", leaders), ("bcast", bcast)):
        if c is not None:
            monkeypatch.setattr(c, "mpi", _StartLog(c.mpi, logs[name]))
    xs = [np.random.default_rng(3 + r).standard_normal(3000) for r in range(n)]
    ys = [np.random.default_rng(50 + r).standard_normal(2000).astype(np.float32)
          for r in range(n)]
    a, b = xs[rank].copy(), xs[rank][:700].copy()
    works = [group.allreduce(a, async_op=True), group.allreduce(b, async_op=True)]
    y = ys[rank].copy()
    compressed_allreduce(y, group=group, hierarchical=True)
    for w in works[::-1]:
        w.wait()
    assert _agrees(a, sum(xs)), f"rank {rank}"
    assert _agrees(b, sum(x[:700] for x in xs)), f"rank {rank}"
    exact = np.mean(ys, axis=0)
    assert np.abs(y - exact).max() <= (exact.max() - exact.min()) / 100 + 1e-6
    monkeypatch.undo()
    for name, c in (("local", local), ("leaders", leaders), ("bcast", bcast)):
        if c is not None and c.size > 1:
            everyone = c.mpi.allgather(logs[name])
            assert all(e == everyone[0] for e in everyone), \
                f"rank {rank}: start order on the {name} communicator differs: {everyone}"
    # the async allreduces started first on the leaders, then the compressed exchange
    if leaders is not None and leaders.size > 1:
        assert logs["leaders"][:2] == ["Iallreduce", "Iallreduce"], logs["leaders"]
