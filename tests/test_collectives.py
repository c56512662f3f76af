"""Every collective against a numpy reference, at any world size (1 included).

Run serially (1 rank) and under ``mpiexec -n N python -m pytest --with-mpi`` for N in
{2, 3, 4}. Inputs are deterministic functions of (rank, size, dtype), so each rank computes
the expected result of the whole group itself.
"""
import numpy as np
import pytest

import commlib
from commlib import ReduceOp
from helpers import (
    NUMPY_DTYPES,
    SIZES,
    TORCH_DTYPES,
    numel_of,
    rank_data,
    to_kind,
    to_numpy,
    tolerance,
)

torch = pytest.importorskip("torch")

CASES = [("numpy", d) for d in NUMPY_DTYPES] + [("torch", d) for d in TORCH_DTYPES]
FLOATS = ("float16", "bfloat16", "float32", "float64")


def world():
    return commlib.get_rank(), commlib.get_world_size()


def inputs(numel, dtype, kind="sum", seed=0):
    _, n = world()
    return [rank_data(r, numel, dtype, kind, seed) for r in range(n)]


def check(actual, expected, dtype):
    got = to_numpy(actual)
    assert got.shape == expected.shape
    if dtype in FLOATS:
        np.testing.assert_allclose(got, expected, rtol=tolerance(dtype), atol=tolerance(dtype))
    else:
        np.testing.assert_array_equal(got, expected)


def maybe_wait(result, async_op):
    if async_op:
        assert isinstance(result, commlib.Work)
        return result.wait()
    return result


REFERENCE = {
    ReduceOp.SUM: lambda xs: np.sum(xs, axis=0),
    ReduceOp.AVG: lambda xs: np.mean(xs, axis=0),
    ReduceOp.MIN: lambda xs: np.min(xs, axis=0),
    ReduceOp.MAX: lambda xs: np.max(xs, axis=0),
    ReduceOp.PRODUCT: lambda xs: np.prod(xs, axis=0),
}


def ops_for(dtype):
    ops = [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
    return ops + [ReduceOp.AVG] if dtype in FLOATS else ops


def data_kind(op):
    return "product" if op is ReduceOp.PRODUCT else "sum"


@pytest.mark.mpi
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind,dtype", CASES)
def test_allreduce(kind, dtype, size, async_op):
    rank, _ = world()
    numel = numel_of(size, dtype)
    for op in ops_for(dtype):
        xs = inputs(numel, dtype, data_kind(op))
        t = to_kind(xs[rank], dtype, kind)
        out = maybe_wait(commlib.allreduce(t, op=op, async_op=async_op), async_op)
        assert out is t
        check(t, REFERENCE[op](np.stack(xs)), dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind,dtype", CASES)
def test_reduce(kind, dtype, size, async_op):
    rank, n = world()
    dst = n - 1
    numel = numel_of(size, dtype)
    for op in (ReduceOp.SUM, ReduceOp.MAX):
        xs = inputs(numel, dtype, seed=1)
        t = to_kind(xs[rank], dtype, kind)
        maybe_wait(commlib.reduce(t, dst=dst, op=op, async_op=async_op), async_op)
        expected = REFERENCE[op](np.stack(xs)) if rank == dst else xs[rank]
        check(t, expected, dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind,dtype", CASES)
def test_broadcast(kind, dtype, size, async_op):
    rank, n = world()
    src = n - 1
    xs = inputs(numel_of(size, dtype), dtype, seed=2)
    t = to_kind(xs[rank], dtype, kind)
    maybe_wait(commlib.broadcast(t, src=src, async_op=async_op), async_op)
    check(t, xs[src], dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind,dtype", CASES)
def test_allgather(kind, dtype, size, async_op):
    rank, n = world()
    xs = inputs(numel_of(size, dtype), dtype, seed=3)
    t = to_kind(xs[rank], dtype, kind)
    out = maybe_wait(commlib.allgather(t, async_op=async_op), async_op)
    assert type(out) is type(t)
    check(out, np.stack(xs), dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind,dtype", CASES)
def test_allgather_v(kind, dtype, size, async_op):
    rank, n = world()
    numel = numel_of(size, dtype)
    rows = [(numel + r) % 5 + (numel if size == "big" else 0) // 4 for r in range(n)]
    xs = [rank_data(r, rows[r] * 2, dtype, seed=4).reshape(rows[r], 2) for r in range(n)]
    t = to_kind(xs[rank], dtype, kind)
    out = maybe_wait(commlib.allgather_v(t, async_op=async_op), async_op)
    assert isinstance(out, list) and len(out) == n
    for r in range(n):
        check(out[r], xs[r], dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind,dtype", CASES)
def test_reduce_scatter(kind, dtype, size, async_op):
    rank, n = world()
    numel = numel_of(size, dtype)
    for op in (ReduceOp.SUM, ReduceOp.AVG if dtype in FLOATS else ReduceOp.MIN):
        xs = inputs(numel, dtype, seed=5)
        t = to_kind(xs[rank], dtype, kind)
        out = maybe_wait(commlib.reduce_scatter(t, op=op, async_op=async_op), async_op)
        full = REFERENCE[op](np.stack(xs)) if numel else np.zeros(0)
        blocks = np.array_split(full, n)
        assert commlib.block_sizes(numel, n) == [len(b) for b in blocks]
        check(out, blocks[rank], dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind,dtype", CASES)
def test_alltoall(kind, dtype, size, async_op):
    rank, n = world()
    per = numel_of(size, dtype) // (4 if size == "big" else 1)
    xs = [rank_data(r, n * per * 3, dtype, seed=6).reshape(n * per, 3) for r in range(n)]
    t = to_kind(xs[rank], dtype, kind)
    out = maybe_wait(commlib.alltoall(t, async_op=async_op), async_op)
    expected = np.concatenate([xs[src][rank * per:(rank + 1) * per] for src in range(n)])
    check(out, expected, dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind,dtype", CASES)
def test_send_recv_ring(kind, dtype, size, async_op):
    rank, n = world()
    xs = inputs(numel_of(size, dtype), dtype, seed=7)
    left, right = (rank - 1) % n, (rank + 1) % n
    out = to_kind(np.zeros_like(xs[rank]), dtype, kind)
    sending = commlib.send(to_kind(xs[rank], dtype, kind), right, tag=3, async_op=True)
    got = maybe_wait(commlib.recv(out, left, tag=3, async_op=async_op), async_op)
    sending.wait()
    assert got is out
    check(out, xs[left], dtype)


@pytest.mark.mpi
def test_barrier_and_async_barrier():
    commlib.barrier()
    work = commlib.barrier(async_op=True)
    work.wait()
    assert work.is_completed()


@pytest.mark.mpi
def test_is_completed_polls_to_completion():
    rank, n = world()
    xs = inputs(1000, "float64", seed=8)
    t = xs[rank].copy()
    work = commlib.allreduce(t, async_op=True)
    while not work.is_completed():
        pass
    np.testing.assert_array_equal(t, np.sum(xs, axis=0))
    assert work.result() is t


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_non_contiguous_buffers_are_handled(kind):
    rank, n = world()
    xs = [rank_data(r, 48, "float64", seed=9).reshape(6, 8) for r in range(n)]
    base = to_kind(xs[rank].copy(), "float64", kind)
    view = base[:, ::2] if kind == "numpy" else base[:, ::2]
    untouched = to_numpy(base[:, 1::2]).copy()
    commlib.allreduce(view)
    check(view, np.sum(xs, axis=0)[:, ::2], "float64")
    check(base[:, 1::2], untouched, "float64")
    gathered = commlib.allgather(view)
    check(gathered[rank], np.sum(xs, axis=0)[:, ::2], "float64")


@pytest.mark.mpi
def test_bool_reduces_logically():
    rank, n = world()
    t = np.array([rank == 0, True, False])
    commlib.allreduce(t, op=ReduceOp.SUM)
    np.testing.assert_array_equal(t, [True, True, False])
    t = np.array([rank == 0, True, False])
    commlib.allreduce(t, op=ReduceOp.MIN)
    np.testing.assert_array_equal(t, [n == 1, True, False])


@pytest.mark.mpi
def test_complex_and_unsigned():
    rank, n = world()
    c = np.array([1 + 2j, rank * 1j], dtype=np.complex64)
    commlib.allreduce(c, op=ReduceOp.AVG)
    np.testing.assert_allclose(c, [1 + 2j, 1j * (n - 1) / 2], rtol=1e-6)
    u = np.array([rank, 200], dtype=np.uint8)
    commlib.allreduce(u, op=ReduceOp.MAX)
    np.testing.assert_array_equal(u, [n - 1, 200])


@pytest.mark.mpi
def test_staged_path_matches_direct(monkeypatch):
    """Host staging (the GPU path on MPI libraries that are not CUDA-aware), exercised with
    CPU torch tensors: same results, staging buffers reused."""
    rank, n = world()
    monkeypatch.setattr(commlib.options, "force_staging", True)
    from commlib.base.buffers import _pool
    for _ in range(3):
        xs = inputs(1000, "bfloat16", seed=10)
        t = to_kind(xs[rank], "bfloat16", "torch")
        commlib.allreduce(t, op=ReduceOp.AVG)
        check(t, np.mean(xs, axis=0), "bfloat16")
        g = commlib.allgather(to_kind(xs[rank], "float32", "torch")[::2])
        check(g, np.stack(xs)[:, ::2], "float32")
    allocations = _pool.allocations
    commlib.allreduce(to_kind(xs[rank], "bfloat16", "torch"))
    commlib.allgather(to_kind(xs[rank], "float32", "torch")[::2])
    assert _pool.allocations == allocations


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_out_buffers_are_filled_and_returned(kind):
    rank, n = world()
    xs = inputs(12 * n, "float32", seed=12)
    t = to_kind(xs[rank], "float32", kind)
    out = to_kind(np.zeros((n, 12 * n)), "float32", kind)
    assert commlib.allgather(t, out=out) is out
    check(out, np.stack(xs), "float32")
    out = to_kind(np.zeros(12 * n), "float32", kind)
    assert commlib.alltoall(t, out=out) is out
    out = to_kind(np.zeros(12), "float32", kind)
    assert commlib.reduce_scatter(t, out=out) is out
    check(out, np.array_split(np.sum(xs, axis=0), n)[rank], "float32")
    with pytest.raises(ValueError, match="argument 'out'"):
        commlib.allgather(t, out=to_kind(np.zeros(3), "float32", kind))
    with pytest.raises(ValueError, match="argument 'out'"):
        commlib.allgather(t, out=to_kind(np.zeros((n, 12 * n)), "float64", kind))
