"""Nonblocking allreduce through the node's shared memory (``async_op=True`` where the tier
takes it): run by the window's thread in issue order (commlib.primitives.shm_turns).

Checked against the blocking tier (the same bytes: the same rank-order reduction) and the
MPI path; many operations in flight, waited in any order, mixed with blocking tier and MPI
collectives; progress without ``wait()``; errors handed to the waiter; the fallbacks to MPI;
torch's DDP over the commlib backend with every bucket on the tier against gloo. Negative
control: ranks that issue two operations in different orders get the wrong sums, and the
check used throughout says so."""
from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest

import commlib
from commlib.base.options import options
from commlib.primitives import node_shm
from helpers import leftover_segments, run_mpi, serial_only, small_window_group
from test_node_shm import as_numpy, compare, make, same_everywhere, valid_ops, values

torch = pytest.importorskip("torch")

HALF = 4096  # bytes of a window half in the test group: several steps per operation


@pytest.fixture(scope="module")
def group():
    """A group over every rank whose window has 4 KiB halves, freed after the module."""
    yield from small_window_group(HALF)


@pytest.fixture
def shm_any_size():
    """``COMMLIB_SHM=1``: the tier at any size, nonblocking calls included."""
    saved = options.shm
    options.shm = "1"
    yield
    options.shm = saved


def issued_on_tier(n_before: int, expected: int) -> None:
    used = node_shm.COUNTS["async"] - n_before
    assert used == (expected if commlib.get_world_size() > 1 else 0), used


@pytest.mark.mpi
@pytest.mark.usefixtures("shm_any_size")
@pytest.mark.parametrize("kind,dtype", [("numpy", "float64"), ("numpy", "float32"),
                                        ("numpy", "int64"), ("numpy", "bool"),
                                        ("numpy", "complex128"), ("torch", "bfloat16"),
                                        ("torch", "float32")])
def test_matches_the_blocking_tier_and_mpi(group, kind, dtype):
    """Every op valid for the dtype, 3 window steps and a bit: the nonblocking result has
    the blocking tier's bytes (the same reduction order), on every rank the same, and
    MPI's values (exact for integers, to reassociation for floats)."""
    r = commlib.get_rank()
    count = 3 * HALF // (2 if dtype == "bfloat16" else np.dtype(dtype).itemsize) + 7
    for op in valid_ops(dtype):
        vals = values(r, count, dtype, op, seed=7)
        before = node_shm.COUNTS["async"]
        work = commlib.allreduce(make(vals, kind, dtype), op, group, async_op=True)
        nonblocking = work.wait()
        issued_on_tier(before, 1)
        blocking = commlib.allreduce(make(vals, kind, dtype), op, group)
        options.shm = "0"
        via_mpi = commlib.allreduce(make(vals, kind, dtype), op, group)
        options.shm = "1"
        np.testing.assert_array_equal(as_numpy(nonblocking), as_numpy(blocking))
        same_everywhere(nonblocking)
        compare(nonblocking, via_mpi, dtype, exact=False)


def _issue_and_check(group, swap: bool) -> None:
    """Four nonblocking allreduces of one size with different contents, a blocking tier
    allreduce and a blocking MPI one among them, waited in reverse order; ``swap``: rank
    1 issues the first two in the other order (the negative control). Raises
    AssertionError when some rank's sums are wrong."""
    r, n = commlib.get_rank(), commlib.get_world_size()
    count = 5 * HALF // 8 + 3
    inputs = [np.arange(count, dtype=np.float64) * (k + 1) + 1000.0 * r for k in range(4)]
    expected = [np.arange(count, dtype=np.float64) * (k + 1) * n + 1000.0 * n * (n - 1) / 2
                for k in range(4)]
    order = [1, 0, 2, 3] if swap and r == 1 else [0, 1, 2, 3]
    works = {}
    for k in order[:2]:
        works[k] = commlib.allreduce(inputs[k], group=group, async_op=True)
    blocking = np.full(count, r + 1.0)
    commlib.allreduce(blocking, group=group)            # the tier: takes its turn
    works[2] = commlib.allreduce(inputs[2], group=group, async_op=True)
    options.shm = "0"
    ranks = commlib.allreduce(np.array([r]), group=group)  # MPI, beside the tier
    options.shm = "1"
    works[3] = commlib.allreduce(inputs[3], group=group, async_op=True)
    for k in (3, 2, 1, 0):
        works[k].wait()
    wrong = [k for k in range(4) if not np.array_equal(inputs[k], expected[k])]
    wrong += ["blocking"] if not (blocking == n * (n + 1) / 2).all() else []
    wrong += ["mpi"] if ranks[0] != n * (n - 1) // 2 else []
    everyone = commlib.world().comm.mpi.allgather(wrong)
    assert not any(everyone), f"wrong sums, per rank: {everyone}"


@pytest.mark.mpi
@pytest.mark.usefixtures("shm_any_size")
def test_issue_order_is_the_order_they_run_in(group):
    """Operations in flight run in issue order on every rank, whatever order they are
    waited in, with blocking tier and MPI collectives among them."""
    before = node_shm.COUNTS["async"]
    for _ in range(3):
        _issue_and_check(group, swap=False)
    issued_on_tier(before, 12)


@pytest.mark.mpi(min_size=2)
@pytest.mark.usefixtures("shm_any_size")
def test_the_order_check_catches_ranks_that_issue_in_different_orders(group):
    """Negative control: rank 1 issues the first two operations swapped; the check of the
    test above must fail (the tier pairs operations by issue order, as MPI does)."""
    with pytest.raises(AssertionError, match="wrong sums"):
        _issue_and_check(group, swap=True)


@pytest.mark.mpi
@pytest.mark.usefixtures("shm_any_size")
def test_it_progresses_without_wait(group):
    """The window's thread runs an issued operation by itself: ``is_completed()`` turns
    True with nobody in ``wait()`` (as a nonblocking MPI collective would, with a
    progress thread)."""
    r, n = commlib.get_rank(), commlib.get_world_size()
    x = np.full(4 * HALF // 4, r + 1.0, np.float32)
    work = commlib.allreduce(x, group=group, async_op=True)
    deadline = time.monotonic() + 30
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert work.is_completed()
    assert (x == n * (n + 1) / 2).all() and work.wait() is x and work.result() is x


@pytest.mark.mpi(min_size=2)
@pytest.mark.usefixtures("shm_any_size")
def test_an_error_reaches_the_waiter_and_the_next_operation_runs(group, monkeypatch):
    """An operation that raises (on every rank, so that no rank waits for a peer) hands
    its error to ``wait()``; the window's next operation runs normally."""
    def fails(*args, **kwargs):
        raise RuntimeError("injected")
    monkeypatch.setattr(node_shm, "reduce_all", fails)
    work = commlib.allreduce(np.ones(HALF, np.float32), group=group, async_op=True)
    with pytest.raises(RuntimeError, match="injected"):
        work.wait()
    monkeypatch.undo()
    x = np.ones(HALF, np.float32)
    commlib.allreduce(x, group=group, async_op=True).wait()
    assert (x == commlib.get_world_size()).all()


@pytest.mark.mpi
def test_where_it_stays_on_mpi(group, monkeypatch):
    """``auto``: below ASYNC_MIN_BYTES and outside the blocking ranges; any size without
    MPI_THREAD_MULTIPLE, in fault-tolerant mode, and with ``COMMLIB_SHM=0``."""
    saved = options.shm
    try:
        options.shm = "auto"
        before = node_shm.COUNTS["async"]
        commlib.allreduce(np.ones(node_shm.ASYNC_MIN_BYTES // 8, np.float32), group=group,
                          async_op=True).wait()
        assert node_shm.COUNTS["async"] == before
        options.shm = "1"
        monkeypatch.setattr(node_shm.runtime, "thread_multiple", lambda: False)
        commlib.allreduce(np.ones(HALF, np.float32), group=group, async_op=True).wait()
        monkeypatch.undo()
        monkeypatch.setattr(options, "fault_tolerant", True)
        assert not node_shm.use_async(group.comm, _buf(np.ones(HALF, np.float32)),
                                      "allreduce")
        monkeypatch.undo()
        options.shm = "0"
        commlib.allreduce(np.ones(HALF, np.float32), group=group, async_op=True).wait()
        assert node_shm.COUNTS["async"] == before
    finally:
        options.shm = saved


def _buf(x):
    from commlib.base.buffers import adapt
    return adapt(x, "tensor", "allreduce", commlib.get_rank(), write=True)


@pytest.mark.mpi
@pytest.mark.usefixtures("shm_any_size")
def test_torch_ddp_over_the_backend_with_buckets_on_the_tier(torch_groups):
    """torch's DDP over the commlib backend, every bucket's allreduce (started with
    ``async_op``) on the tier's thread, trains like gloo to 1e-10 after every step
    (float64); the same test file's negative control is test_torch_backend_ddp's broken
    backend, which the same comparison rejects."""
    from test_torch_backend_ddp import TOL, max_differences, train
    world, gloo = torch_groups
    before = node_shm.COUNTS["async"]
    ours = train(world)
    used = node_shm.COUNTS["async"] - before
    options.shm = "0"
    theirs = train(gloo)
    options.shm = "1"
    diffs = max_differences(ours, theirs)
    assert max(diffs) < TOL, f"commlib (tier) vs gloo, per step: {diffs}"
    assert commlib.get_world_size() == 1 or used >= 12, used  # every step's buckets
    replicas = commlib.allgather(ours[-1])
    np.testing.assert_array_equal(replicas, np.broadcast_to(ours[-1], replicas.shape))


PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "node_shm_async_program.py")


@serial_only
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["nowait", "exit1"])
def test_exit_with_a_nonblocking_operation_pending(mode):
    """``nowait``: ranks that end without waiting end normally (status 0: the window's
    thread is stopped before MPI finalizes, after running what was issued, and the window
    is freed); ``exit1``:
    rank 1's ``sys.exit(1)`` while rank 0 waits on the tier ends the job with status 1
    within the exit window (2 s here) plus a little, naming the operation; nothing hangs,
    nothing is left in /dev/shm."""
    status, seconds, out = run_mpi(2, [PROGRAM, mode], 90, COMMLIB_EXIT_WINDOW="2")
    assert status != -9, f"hang\n{out[-3000:]}"
    if mode == "nowait":
        assert status == 0 and out.count("RESULT") == 2, out[-3000:]
        # every rank ended normally: the window is freed before MPI_Finalize
        # (shm_window.free_at_exit; left to MPI_Finalize, MPICH's OFI netmod failed there)
        # (the two ranks' lines may interleave: "FREED rank 1 TrueFREED rank 0 True")
        freed = sorted(re.findall(r"FREED rank (\d+) (True|False)", out))
        assert freed == [("0", "True"), ("1", "True")], out[-3000:]
    else:
        assert status == 1 and "sys.exit(1)" in out and "RESULT" not in out, out[-3000:]
    assert not leftover_segments(out), leftover_segments(out)
