"""gather, scatter, alltoall_v (uneven blocks), recv_any and the bitwise reductions,
against numpy references every rank computes for every rank."""
import numpy as np
import pytest

import commlib
from commlib import ReduceOp
from helpers import rank_data, to_kind, to_numpy


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("async_op", [False, True])
def test_gather_to_every_root(kind, async_op):
    rank, n = commlib.get_rank(), commlib.get_world_size()
    xs = [rank_data(r, 6, "float64", seed=3).reshape(2, 3) for r in range(n)]
    for dst in range(n):
        got = commlib.gather(to_kind(xs[rank], "float64", kind), dst=dst, async_op=async_op)
        if async_op:
            got = got.wait()
        if rank == dst:
            assert got.shape == (n, 2, 3)
            np.testing.assert_array_equal(to_numpy(got), np.stack(xs))
        else:
            assert got is None


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("async_op", [False, True])
def test_scatter_from_every_root(kind, async_op):
    rank, n = commlib.get_rank(), commlib.get_world_size()
    for src in range(n):
        data = rank_data(src, 4 * n, "float64", seed=5).reshape(n, 4)
        out = to_kind(np.zeros(4), "float64", kind)
        send = to_kind(data, "float64", kind) if rank == src else None
        got = commlib.scatter(out, send, src=src, async_op=async_op)
        if async_op:
            got = got.wait()
        assert got is out
        np.testing.assert_array_equal(to_numpy(out), data[rank])


@pytest.mark.mpi
def test_scatter_checks_the_source_buffer():
    rank, n = commlib.get_rank(), commlib.get_world_size()
    if rank == 0:
        with pytest.raises(ValueError, match="'data' must hold"):
            commlib.scatter(np.zeros(3), np.zeros(3 * n + 1), src=0)
        with pytest.raises(ValueError, match="'data' is required"):
            commlib.scatter(np.zeros(3), None, src=0)


def _splits(i: int, j: int) -> int:
    """Rows rank i sends rank j: uneven, some zero."""
    return (i + 2 * j) % 3


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("known", [True, False])
@pytest.mark.parametrize("async_op", [False, True])
def test_alltoall_v_uneven(kind, known, async_op):
    rank, n = commlib.get_rank(), commlib.get_world_size()
    send = [_splits(rank, j) for j in range(n)]
    recv = [_splits(i, rank) for i in range(n)] if known else None
    inputs = [rank_data(i, 2 * sum(_splits(i, j) for j in range(n)), "float64", seed=9)
              .reshape(-1, 2) for i in range(n)]

    def block(i: int, j: int) -> np.ndarray:
        start = sum(_splits(i, k) for k in range(j))
        return inputs[i][start:start + _splits(i, j)]

    got = commlib.alltoall_v(to_kind(inputs[rank], "float64", kind), send, recv,
                             async_op=async_op)
    if async_op:
        got = got.wait()
    expected = np.concatenate([block(i, rank) for i in range(n)])
    assert tuple(got.shape) == expected.shape
    np.testing.assert_array_equal(to_numpy(got), expected)


@pytest.mark.mpi
def test_alltoall_v_rejects_bad_splits():
    n = commlib.get_world_size()
    with pytest.raises(ValueError, match="must add up"):
        commlib.alltoall_v(np.zeros((n + 1, 2)), [1] * n, [1] * n)
    with pytest.raises(ValueError, match="one non-negative row count per rank"):
        commlib.alltoall_v(np.zeros((1, 2)), [1] + [0] * n, [1] * n)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("async_op", [False, True])
def test_recv_any_reports_each_sender(async_op):
    rank, n = commlib.get_rank(), commlib.get_world_size()
    tag = 4 + async_op  # each case its own tag: a fast sender's next message never matches
    if rank == 0:
        seen = set()
        for _ in range(n - 1):
            x = np.zeros(3)
            src = commlib.recv_any(x, tag=tag, async_op=async_op)
            if async_op:
                src = src.wait()
            np.testing.assert_array_equal(x, [src, src, src])
            seen.add(src)
        assert seen == set(range(1, n))
    else:
        commlib.send(np.full(3, float(rank)), dst=0, tag=tag)
    commlib.barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("op,fn", [(ReduceOp.BAND, np.bitwise_and),
                                   (ReduceOp.BOR, np.bitwise_or),
                                   (ReduceOp.BXOR, np.bitwise_xor)])
def test_bitwise_reductions(op, fn):
    rank, n = commlib.get_rank(), commlib.get_world_size()
    xs = [np.random.default_rng(r).integers(0, 1 << 30, 17) for r in range(n)]
    x = xs[rank].copy()
    commlib.allreduce(x, op=op)
    np.testing.assert_array_equal(x, fn.reduce(np.stack(xs)))
    flags = np.array([rank % 2 == 0, True, False])
    commlib.allreduce(flags, op=op)
    column = np.array([[r % 2 == 0, True, False] for r in range(n)])
    np.testing.assert_array_equal(flags, fn.reduce(column))
    with pytest.raises(ValueError, match="needs an integer or bool buffer"):
        commlib.allreduce(np.ones(2), op=op)
