"""The group's ``timeout`` over the commlib backend, as gloo honours it: a rank whose peer
never joins raises a catchable ``DistBackendError`` ("Timed out") after the timeout, the
group is unusable on that rank afterwards (a clear error, never a mix-up), other groups
and new groups work; and ``commlib.torch_backend.monitored_barrier`` names the ranks that
did not arrive. The missing rank is always the last one; the others wait for it."""
import re
import time
from datetime import timedelta

import numpy as np
import pytest

import commlib

torch = pytest.importorskip("torch")
dist = torch.distributed
monitored_barrier = commlib.torch_backend.monitored_barrier

TIMEOUT = timedelta(seconds=1)
# torch's own check of gloo's message (distributed_test._test_barrier_timeout)
TIMED_OUT = re.compile(" (Timed out|closed|timeout) ")


def world_barrier():
    """A barrier on commlib's world communicator: keeps the phases apart, whatever the
    torch groups are doing."""
    commlib.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["barrier", "all_reduce", "all_gather_single"])
def test_collective_times_out_like_gloo_and_the_group_stays_unusable(torch_groups, op):
    r, n = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="commlib", timeout=TIMEOUT)
    t = torch.ones(4, dtype=torch.float64)
    out = torch.zeros(4 * n, dtype=torch.float64)
    call = {"barrier": lambda: dist.barrier(group=group),
            "all_reduce": lambda: dist.all_reduce(t, group=group),
            "all_gather_single": lambda: dist.all_gather_single(out, t, group=group)}
    if r != n - 1:
        start = time.monotonic()
        with pytest.raises(dist.DistBackendError) as err:
            call[op]()
        waited = time.monotonic() - start
        assert waited >= 1.0 - 0.1, f"raised after {waited:.2f} s, before the timeout"
        assert TIMED_OUT.search(str(err.value)), str(err.value)
        assert isinstance(err.value, RuntimeError)
        with pytest.raises(dist.DistBackendError, match="unusable"):
            dist.all_reduce(t, group=group)               # refused at once, every op
        with pytest.raises(dist.DistBackendError, match="unusable"):
            dist.broadcast(t, src=0, group=group)
    world_barrier()
    if r == n - 1:
        call[op]()            # arrives late: completes against the abandoned collective
    dist.destroy_process_group(group)
    world_barrier()
    # a new group works (its own timeout generous: 1 s is a scheduling hiccup at 4 ranks
    # on 2 loaded cores, and this part is not about timing out)
    fresh = dist.new_group(backend="commlib", timeout=timedelta(seconds=60))
    x = torch.full((3,), float(r), dtype=torch.float64)
    dist.all_reduce(x, group=fresh)
    np.testing.assert_array_equal(x.numpy(), np.full(3, n * (n - 1) / 2))
    dist.destroy_process_group(fresh)


@pytest.mark.mpi(min_size=2)
def test_async_work_wait_timeout_leaves_the_operation_going(torch_groups):
    r, n = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="commlib", timeout=timedelta(seconds=60))
    t = torch.full((5,), float(r + 1), dtype=torch.float64)
    if r != n - 1:
        work = dist.all_reduce(t, group=group, async_op=True)
        with pytest.raises(dist.DistBackendError, match="Timed out"):
            work.wait(timeout=timedelta(seconds=0.3))
    world_barrier()
    if r == n - 1:
        work = dist.all_reduce(t, group=group, async_op=True)
    work.wait()                                   # the late rank arrived: it completes
    np.testing.assert_array_equal(t.numpy(), np.full(5, n * (n + 1) / 2))
    dist.all_reduce(t, group=group)               # and the group is fine
    dist.destroy_process_group(group)


@pytest.mark.mpi(min_size=2)
def test_point_to_point_times_out_and_the_group_stays_usable(torch_groups):
    r, n = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="commlib", timeout=TIMEOUT)
    got = torch.zeros(2, dtype=torch.float64)
    if r == 0:
        with pytest.raises(dist.DistBackendError, match="Timed out"):
            dist.recv(got, src=n - 1, group=group)     # nobody sends: cancelled
    world_barrier()
    if r == 0:
        dist.recv(got, src=n - 1, group=group)
        np.testing.assert_array_equal(got.numpy(), [7.0, 7.0])
    elif r == n - 1:
        dist.send(torch.full((2,), 7.0, dtype=torch.float64), dst=0, group=group)
    dist.barrier(group=group)
    dist.destroy_process_group(group)


@pytest.mark.mpi(min_size=2)
def test_monitored_barrier_names_the_missing_ranks(torch_groups):
    r, n = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="commlib", timeout=timedelta(seconds=30))
    timeout = timedelta(milliseconds=800)
    if r != n - 1:                                  # the last rank does not arrive
        expected = (f"[Rank 0]: Rank {n - 1} failed to pass monitoredBarrier in 800 ms"
                    if r == 0 else f"Rank {r} successfully reached monitoredBarrier")
        with pytest.raises(dist.DistBackendError, match=re.escape(expected)):
            monitored_barrier(group, timeout)
    world_barrier()
    if r == 0:                                      # nobody else arrives
        with pytest.raises(dist.DistBackendError) as err:
            monitored_barrier(group, timeout, wait_all_ranks=True)
        missing = ", ".join(str(k) for k in range(1, n))
        assert str(err.value) == (f"[Rank 0]: Ranks {missing} failed to pass "
                                  f"monitoredBarrier in 800 ms")
    world_barrier()
    monitored_barrier(group, timeout)               # everyone: passes, the group is fine
    monitored_barrier(group, wait_all_ranks=True)
    x = torch.ones(2, dtype=torch.float64)
    dist.all_reduce(x, group=group)
    np.testing.assert_array_equal(x.numpy(), [n, n])
    dist.destroy_process_group(group)


@pytest.mark.mpi
def test_monitored_barrier_refuses_other_groups(torch_groups):
    _, gloo = torch_groups
    with pytest.raises(TypeError, match="process group of the commlib backend"):
        monitored_barrier(gloo)
    monitored_barrier(torch_groups[0], timedelta(seconds=30))
