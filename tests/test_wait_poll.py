"""How blocking calls wait (option ``wait_poll_us``): blocking inside MPI, or, in poll mode,
the call's nonblocking form tested with sleeps between tests, so that ranks outnumbering
the cores leave them to the ranks that compute. The decision is the job's (every rank
decides the same from the same exchange at init): a collective is started blocking on
every rank or nonblocking on every rank, since MPI never matches the two."""
from __future__ import annotations

import numpy as np
import pytest

import commlib
from commlib.core import runtime
from commlib.primitives import (
    _base,
    allgather,
    allgather_v,
    allreduce,
    alltoall,
    alltoall_v,
    barrier,
    broadcast,
    gather,
    new_group,
    recv,
    recv_any,
    reduce,
    reduce_scatter,
    scatter,
    send,
    sendrecv,
)


def test_emulated_nodes_on_one_machine_count_as_one_machine():
    """A rank in its own network and UTS namespace (another host name: the two-tier
    emulation, a container) shares this machine's cores: it names the same machine."""
    import shutil
    import subprocess
    import sys
    outer = runtime._machine()
    if not outer.startswith("boot:") or shutil.which("unshare") is None:
        pytest.skip("no boot id or no unshare here")
    code = "from commlib import runtime; print(runtime._machine())"
    got = subprocess.run(["unshare", "--net", "--uts", "sh", "-c",
                          f"hostname emulated-node-7 && hostname && {sys.executable} -c '{code}'"],
                         capture_output=True, text=True, timeout=120)
    if got.returncode != 0 and "Operation not permitted" in got.stderr:
        pytest.skip("namespaces need root")
    assert got.returncode == 0, got.stderr
    name, machine = got.stdout.split()
    assert name == "emulated-node-7"
    assert machine == outer


def test_the_job_decides_from_every_host():
    one_host = [(r, "a", 2) for r in range(2)]
    assert runtime.wait_poll_s(one_host, "auto") == 0.0
    assert runtime.wait_poll_s(one_host + [(2, "a", 2)], "auto") == runtime.AUTO_POLL_S
    # one oversubscribed host is enough: every rank polls
    two_hosts = [(0, "a", 4), (1, "a", 4), (2, "b", 1), (3, "b", 1)]
    assert runtime.wait_poll_s(two_hosts, "auto") == runtime.AUTO_POLL_S
    assert runtime.wait_poll_s([(0, "a", 1), (1, "b", 1)], "auto") == 0.0
    # ranks bound to a core each (Open MPI's and Intel MPI's default): the host's CPUs are
    # the union of their affinities (measured before: a 2-rank job on 2 cores polled there,
    # a 2-float allreduce 238-327 us instead of 10)
    bound = [(0, "a", (0,)), (1, "a", (1,))]
    assert runtime.wait_poll_s(bound, "auto") == 0.0
    assert runtime.wait_poll_s(bound + [(2, "a", (1,))], "auto") == runtime.AUTO_POLL_S
    assert runtime.wait_poll_s([(0, "a", (0,)), (1, "a", (0,))], "auto") == runtime.AUTO_POLL_S
    assert runtime.wait_poll_s(two_hosts, 0.0) == 0.0
    assert runtime.wait_poll_s(one_host, 20.0) == pytest.approx(20e-6)
    with pytest.raises(ValueError, match="microseconds"):
        commlib.options.update(wait_poll_us=-1)


class Recorder:
    """The communicator's MPI object, recording which of its calls were made."""

    def __init__(self, mpi):
        self._mpi, self.calls = mpi, []

    def __getattr__(self, name):
        value = getattr(self._mpi, name)
        if not (name[:1].isupper() and callable(value)):
            return value

        def call(*args, **kwargs):
            self.calls.append(name)
            return value(*args, **kwargs)
        call.__name__ = name
        return call


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("poll_us", [0, 50])
def test_every_blocking_primitive_in_both_modes(poll_us):
    group = new_group()            # its own communicator: the mode is set on every rank
    comm = group.comm
    comm.poll_s = poll_us * 1e-6
    recorder = Recorder(comm.mpi)
    comm.mpi = recorder
    try:
        r, n = comm.rank, comm.size
        x = np.full(6 * n, r + 1.0)
        assert np.all(allreduce(x.copy(), group=group) == n * (n + 1) / 2)
        b = np.full(5, float(r))
        assert np.all(broadcast(b, src=n - 1, group=group) == n - 1)
        barrier(group=group)
        red = reduce(x.copy(), dst=0, group=group)
        if r == 0:
            assert np.all(red == n * (n + 1) / 2)
        rs = reduce_scatter(np.arange(2.0 * n), group=group)
        assert rs.tolist() == [2.0 * r * n, (2 * r + 1.0) * n]
        assert allgather(np.array([float(r)]), group=group).reshape(-1).tolist() == list(range(n))
        v = allgather_v(np.full(r + 1, float(r)), group=group)
        assert np.concatenate(v).tolist() == [float(k) for k in range(n) for _ in range(k + 1)]
        a = alltoall(np.full(n, float(r)), group=group)
        assert a.reshape(-1).tolist() == list(map(float, range(n)))
        av = alltoall_v(np.full(n * (r + 1), float(r)), [r + 1] * n, group=group)
        assert av.reshape(-1).tolist() == [float(k) for k in range(n) for _ in range(k + 1)]
        g = gather(np.array([float(r)]), dst=0, group=group)
        if r == 0:
            assert g.reshape(-1).tolist() == list(map(float, range(n)))
        s = np.empty(2)
        scatter(s, np.arange(2.0 * n) if r == 0 else None, src=0, group=group)
        assert s.tolist() == [2.0 * r, 2.0 * r + 1]
        # p2p around the ring, of several sizes in a row (a status with the wrong count
        # fails the size check of sendrecv/recv)
        right, left = (r + 1) % n, (r - 1) % n
        for size in (362, 16, 1):
            got = np.empty(size)
            sendrecv(np.full(size, float(r)), right, got, left, tag=size, group=group)
            assert np.all(got == left)
        if r == 0:
            send(np.arange(3.0), 1, tag=7, group=group)
        elif r == 1:
            assert recv(np.empty(3), 0, tag=7, group=group).tolist() == [0.0, 1.0, 2.0]
        if r == 1:
            send(np.array([9.0]), 0, tag=8, group=group)
        elif r == 0:
            assert recv_any(np.empty(1), tag=8, group=group) == 1
    finally:
        comm.mpi = recorder._mpi
    blocking_forms = {"Allreduce", "Bcast", "Barrier", "Reduce", "Reduce_scatter",
                      "Allgather", "Allgatherv", "Alltoall", "Alltoallv", "Gather", "Scatter",
                      "Sendrecv", "Send", "Recv"}
    used = set(recorder.calls)
    if poll_us:
        assert not used & blocking_forms, f"poll mode made blocking calls: {used & blocking_forms}"
        assert {"Iallreduce", "Ibcast", "Ibarrier", "Ireduce_scatter", "Iallgather",
                "Ialltoall", "Igather", "Iscatter", "Irecv", "Isend"} <= used, used
    else:
        assert {"Allreduce", "Bcast", "Barrier", "Sendrecv"} <= used, used
    group.free()


def test_every_mapped_call_exists():
    from mpi4py import MPI
    for blocking_name, start in _base._NONBLOCKING.items():
        assert hasattr(MPI.Intracomm, blocking_name)
        assert start is None or hasattr(MPI.Intracomm, start), start
