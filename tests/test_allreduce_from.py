"""``commlib.primitives.allreduce_from``: the reduction of every rank's concatenated pieces
into one flat buffer, with the gathering copy fused into the shared-memory tier (DDP's
bucket copy, issue 33 section 3).

Each case runs through the tier (``COMMLIB_SHM=1``) and through MPI (``COMMLIB_SHM=0``) and
compares against ``allreduce`` of the concatenation on the same path: bitwise equal (the
same reduction in the same order), the same bytes on every rank, the pieces that are not
slices of ``out`` untouched, ``node_shm.COUNTS`` saying which path ran. Negative control:
the comparison rejects a result whose pieces were gathered in the wrong order. Then DDP:
the fused path leaves every gradient as its bucket view without the copy (``_bind`` never
runs in a synced backward), equals single-process training in float64, and an algorithm
that replaces ``on_bucket_ready`` gets filled buckets as before (control).
"""
from __future__ import annotations

import numpy as np
import pytest

import commlib
from commlib import ReduceOp
from commlib.base.options import options
from commlib.primitives import allreduce_from, node_shm
from helpers import small_window_group, to_kind, to_numpy

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

HALF = 4096  # bytes of a window half in the test group: several steps stay cheap
CASES = [("numpy", "float64"), ("numpy", "float32"), ("numpy", "int32"),
         ("torch", "float32"), ("torch", "bfloat16"), ("torch", "int64")]
SIZES = {"tiny": 7, "below": 300, "steps": 3 * 1024 + 5}


@pytest.fixture(scope="module")
def group():
    yield from small_window_group(HALF)


@pytest.fixture
def setting():
    saved = options.shm
    yield
    options.shm = saved


def inputs(rank: int, count: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([rank, count, len(dtype)])
    if dtype.startswith("int"):
        return rng.integers(-1000, 1000, count).astype(np.float64)
    if dtype == "bfloat16":
        return rng.integers(-32, 33, count) / 8.0
    return rng.uniform(-1, 1, count)


def cuts(count: int) -> list[int]:
    """Uneven piece boundaries (the same on every rank), an empty piece included."""
    return sorted({0, count, min(count, 1), count // 3, count // 3, count * 2 // 3})


def pieces_of(out, vals: np.ndarray, kind: str, dtype: str, order=None):
    """Pieces over ``vals``: odd ones slices of ``out`` (already holding their values,
    as a gradient bound to its bucket view), even ones separate buffers."""
    bounds = cuts(len(vals))
    spans = list(zip(bounds, bounds[1:]))
    pieces = []
    for k, (lo, hi) in enumerate(spans):
        if k % 2:
            out[lo:hi] = to_kind(vals[lo:hi], dtype, kind)
            pieces.append(out[lo:hi])
        else:
            pieces.append(to_kind(vals[lo:hi], dtype, kind))
    if order is not None:
        pieces = [pieces[i] for i in order]
    return pieces


def everywhere_equal(a: np.ndarray) -> None:
    from mpi4py import MPI
    everyone = MPI.COMM_WORLD.allgather(a.tobytes())
    assert all(e == everyone[0] for e in everyone)


@pytest.mark.mpi
@pytest.mark.usefixtures("setting")
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("kind,dtype", CASES)
@pytest.mark.parametrize("shm", ["1", "0"])
def test_equals_allreduce_of_the_concatenation(group, kind, dtype, size, shm):
    rank, n = group.rank, group.size
    count = SIZES[size]
    vals = inputs(rank, count, dtype)
    ops = [ReduceOp.SUM, ReduceOp.MAX] + ([ReduceOp.AVG] if not dtype.startswith("int")
                                          else [])
    options.shm = shm
    for op in ops:
        expected = to_kind(vals, dtype, kind)
        commlib.allreduce(expected, op=op, group=group)
        out = to_kind(np.zeros(count), dtype, kind)
        pieces = pieces_of(out, vals, kind, dtype)
        separate = [(p, to_numpy(p)) for k, p in enumerate(pieces) if k % 2 == 0]
        before = node_shm.COUNTS["allreduce"]
        result = allreduce_from(pieces, out, op=op, group=group)
        assert result is out
        ran_tier = node_shm.COUNTS["allreduce"] - before
        assert ran_tier == (1 if shm == "1" and n > 1 else 0)
        np.testing.assert_array_equal(to_numpy(out), to_numpy(expected))
        everywhere_equal(to_numpy(out))
        for p, saved in separate:
            np.testing.assert_array_equal(to_numpy(p), saved)


@pytest.mark.mpi
@pytest.mark.usefixtures("setting")
@pytest.mark.parametrize("shm", ["1", "0"])
def test_async_and_the_negative_control(group, shm):
    """async_op gives a Work or the finished tensor; pieces gathered out of order (a
    broken gather) give a result the comparison rejects."""
    options.shm = shm
    count = SIZES["steps"]
    vals = inputs(group.rank, count, "float64")
    expected = torch.tensor(vals)
    commlib.allreduce(expected, group=group)
    out = torch.zeros(count, dtype=torch.float64)
    work = allreduce_from(pieces_of(out, vals, "torch", "float64"), out, group=group,
                          async_op=True)
    assert (work.wait() if hasattr(work, "wait") else work) is out
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    wrong = torch.zeros(count, dtype=torch.float64)
    bounds = cuts(count)
    order = list(range(len(bounds) - 1))
    order[0], order[2] = order[2], order[0]
    shuffled = pieces_of(torch.zeros(count, dtype=torch.float64), vals, "torch", "float64",
                         order)
    allreduce_from(shuffled, wrong, group=group)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(wrong, expected, rtol=0, atol=0)


@pytest.mark.mpi
def test_errors_name_the_argument(group):
    out = torch.zeros(10)
    with pytest.raises(ValueError, match="pieces hold 9 elements, out holds 10"):
        allreduce_from([torch.zeros(4), torch.zeros(5)], out, group=group)
    with pytest.raises(TypeError, match=r"pieces\[1\].*float32"):
        allreduce_from([torch.zeros(4), torch.zeros(6, dtype=torch.float64)], out,
                       group=group)
    with pytest.raises(TypeError, match=r"pieces\[0\]"):
        allreduce_from([np.zeros(10, np.float32)], out, group=group)
    with pytest.raises(ValueError, match="out must be 1-D"):
        allreduce_from([torch.zeros(4)], torch.zeros(2, 2), group=group)


# -- DDP: the bucket copy fused into the exchange ---------------------------------------------

def _train(algorithm, shm: str, steps: int = 4):
    """DDP (this rank's slice) and one process (the whole batch) in float64, compared
    after every step; returns how often ``_bind`` copied in synced backwards and the
    shared-memory calls made."""
    from commlib.ddp import hooks
    torch.manual_seed(0)
    rank, n = commlib.get_rank(), commlib.get_world_size()

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 4)).double()

    ref, ddp = net(), commlib.DistributedDataParallel(net(), bucket_cap_mb=0.02,
                                                      algorithm=algorithm)
    assert len(ddp._ctx.buckets) >= 3
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    copies = [0]
    original = hooks._bind

    def counting(p, view):
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            copies[0] += 1
        original(p, view)

    saved = options.shm
    options.shm = shm
    hooks._bind = counting
    before = node_shm.COUNTS["allreduce"]
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4 * n, 16, generator=g, dtype=torch.float64), \
                torch.randint(0, 4, (4 * n,), generator=g)
            mine = slice(4 * rank, 4 * rank + 4)
            opt.zero_grad()
            F.cross_entropy(ddp(x[mine]), y[mine]).backward()
            for bucket in ddp._ctx.buckets:  # every gradient is its bucket's view
                for p, view in zip(bucket.tensors, bucket.views):
                    assert p.grad.data_ptr() == view.data_ptr()
            opt.step()
            ref_opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            ref_opt.step()
            for a, b in zip(ddp.module.parameters(), ref.parameters()):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    finally:
        hooks._bind = original
        options.shm = saved
        ddp.close()
    return copies[0], node_shm.COUNTS["allreduce"] - before


@pytest.mark.mpi
@pytest.mark.parametrize("shm", ["1", "0"])
def test_ddp_gathers_gradients_in_the_exchange(shm):
    copies, tier_calls = _train("gradient_allreduce", shm)
    assert copies == 0  # no gradient copied into its bucket before the exchange
    n = commlib.get_world_size()
    assert (tier_calls > 0) == (shm == "1" and n > 1)


@pytest.mark.mpi
def test_ddp_algorithm_that_replaces_the_exchange_gets_filled_buckets():
    """Control: a subclass with its own on_bucket_ready is not fused; its buckets hold
    every gradient (copied by _bind) when it runs."""
    from commlib.algorithms.gradient_allreduce import GradientAllReduce
    from commlib.primitives import allreduce

    class Mine(GradientAllReduce):
        def on_bucket_ready(self, ctx, bucket):
            assert bucket.deferred == 0
            return allreduce(bucket.flat, op=ReduceOp.AVG, group=ctx.group, async_op=True)

    copies, _ = _train(Mine(), "0")
    assert copies > 0
