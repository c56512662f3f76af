"""The two-tier cluster emulation of ``benchmarks/netsim.py``: shaped inter-node rate,
separate hosts with shared memory inside each, delay (netem, or the TUN delay line of
``benchmarks/delayline.py`` where the kernel has no netem), per-node CPU pinning, and clean
teardown (serial: each test builds its own cluster of namespaces and runs ``mpiexec`` or
socket probes inside it). The cluster tests need root, ``ip``, ``tc`` and bridge/veth
support and are skipped otherwise; the delay line's own timing test runs anywhere."""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import delayline  # noqa: E402
import netsim  # noqa: E402

OK, WHY = netsim.can_build_cluster()
needs_cluster = pytest.mark.skipif(not OK, reason=f"no two-tier emulation here: {WHY}")

PROBE_BYTES = 4 << 20  # 0.34 s at 100 Mbit/s


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@needs_cluster
def test_inter_node_rate_is_shaped_and_unshaped_is_not():
    with netsim.two_tier(nodes=2, ranks_per_node=1, rate_mbit=100, delay_ms=0.5) as cluster:
        assert cluster.shaped, cluster.why
        shaped = cluster.measure_bandwidth(0, 1, nbytes=PROBE_BYTES)
        names = set(cluster._namespaces)
        assert names <= _namespaces()
    assert shaped["hosts"] == ["node0", "node1"]
    assert abs(shaped["mbit"] - 100) <= 15, shaped
    if cluster.delay_applied:
        assert shaped["rtt_ms"] >= 1.0, shaped  # 0.5 ms each way
    else:  # kernel without netem: the cluster must say the delay was not applied
        assert "NOT applied" in cluster.why, cluster.why
    assert not names & _namespaces(), "namespaces left behind"
    # negative control: the same measurement without shaping is far above the limit, so the
    # check above can fail
    with netsim.two_tier(nodes=2, ranks_per_node=1, rate_mbit=None) as cluster:
        free = cluster.measure_bandwidth(0, 1, nbytes=PROBE_BYTES)
    assert free["mbit"] > 300, free
    assert not (abs(free["mbit"] - 100) <= 15)


PROGRAM = r"""
import json, os, socket, sys
import commlib
from commlib.mpi.mpi_env import _node
from mpi4py import MPI
commlib.init()
local_rank, local_size = _node(MPI.COMM_WORLD)
with open(os.path.join(sys.argv[1], f"{commlib.get_rank()}.json"), "w") as fh:
    json.dump({"host": socket.gethostname(), "local_size": local_size,
               "local_rank": local_rank, "local_world": os.environ.get("LOCAL_WORLD_SIZE"),
               "master": os.environ.get("MASTER_ADDR")}, fh)
"""


@needs_cluster
def test_2x2_ranks_share_a_node_two_hosts(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    with netsim.two_tier(nodes=2, ranks_per_node=2, rate_mbit=1000) as cluster:
        code = cluster.mpiexec([sys.executable, str(script), str(tmp_path)], timeout=120)
    assert code == 0
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert [r["host"] for r in ranks] == ["node0", "node0", "node1", "node1"]
    assert all(r["local_size"] == 2 and r["local_world"] == "2" for r in ranks), ranks
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert {r["master"] for r in ranks} == {"10.13.0.1"}  # node 0's address, not loopback


@needs_cluster
@pytest.mark.parametrize("delay_ms", [0, 5])
def test_teardown_after_exception(delay_ms):
    """Ctrl-C inside the block: namespaces (and the delay line, where there is one) go."""
    with pytest.raises(KeyboardInterrupt):
        with netsim.two_tier(nodes=2, ranks_per_node=1, rate_mbit=100,
                             delay_ms=delay_ms) as cluster:
            names = set(cluster._namespaces)
            assert len(names) == 3 and names <= _namespaces()
            pid = cluster._forwarder.pid if cluster._forwarder else None
            assert pid is None or _alive(pid)
            raise KeyboardInterrupt
    assert not names & _namespaces()
    assert pid is None or not _alive(pid)


GLOO_PROGRAM = r"""
import json, os, sys, time
import torch
import torch.distributed as dist
import commlib
torch.set_num_threads(1)
commlib.init()
dist.init_process_group("gloo")  # env:// from commlib's publishing: MASTER_ADDR of node 0
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 4))
model(torch.randn(8, 64)).sum().backward()  # one DDP step over gloo across the nodes
grad = model.module.weight.grad.clone()
t = torch.ones(1 << 20)  # 4 MiB
dist.all_reduce(t)
dist.barrier()
start = time.perf_counter()
dist.all_reduce(t)
seconds = time.perf_counter() - start
out = [None] * dist.get_world_size()
dist.all_gather_object(out, grad.sum().item())
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as fh:
        json.dump({"mbit": 4 * 2**20 * 8 / seconds / 1e6, "grads": out,
                   "master": os.environ["MASTER_ADDR"], "sum": t[0].item()}, fh)
dist.destroy_process_group()
"""


@needs_cluster
def test_gloo_ddp_crosses_the_shaped_link(tmp_path):
    """torch DDP over gloo runs across emulated nodes (rendezvous on node 0's address) and
    its traffic is limited: a 4 MiB gloo allreduce between 2 nodes at 100 Mbit/s moves at
    most the link rate (unshaped it is above 300 Mbit/s: the test above)."""
    script, out = tmp_path / "gloo.py", tmp_path / "gloo.json"
    script.write_text(GLOO_PROGRAM)
    with netsim.two_tier(nodes=2, ranks_per_node=1, rate_mbit=100) as cluster:
        code = cluster.mpiexec([sys.executable, str(script), str(out)], timeout=120)
    assert code == 0
    r = json.loads(out.read_text())
    assert r["master"] == "10.13.0.1" and r["sum"] == 4.0  # two allreduces of ones
    assert r["grads"][0] == r["grads"][1]  # DDP averaged the gradients across the nodes
    assert r["mbit"] < 115, r


# -- delay: netem or the TUN delay line ----------------------------------------------------

def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running delay line (not a reused pid, not a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read()
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return b"delayline.py" in cmd and state != "Z"


def _tun_devices() -> str:
    return subprocess.run(["ip", "-o", "link", "show", "type", "tun"], capture_output=True,
                          text=True).stdout


def test_delay_line_holds_packets_in_order_and_drops_at_the_loss_rate():
    """:func:`delayline.forward` on a datagram socket pair instead of a TUN device (the
    same fd is read and written, as with TUN): every packet comes back after >= the delay
    (and not much later on an idle-enough machine), in order; seeded 30 % loss drops about
    30 %. Runs without root."""
    def run(delay_s, loss, n):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        stop_r, stop_w = os.pipe()
        result = {}
        worker = threading.Thread(target=lambda: result.update(
            delayline.forward(ours.fileno(), delay_s, loss, lifeline=stop_r, seed=1)))
        worker.start()
        sent, arrived = {}, []

        def receive():  # its own thread, so that arrival times are not sending times
            theirs.settimeout(delay_s + 0.5)  # the end, once every packet is in
            with contextlib.suppress(socket.timeout, OSError):
                while len(arrived) < n:
                    packet = theirs.recv(4096)
                    arrived.append((int.from_bytes(packet[:4], "big"), time.monotonic()))
        receiver = threading.Thread(target=receive)
        receiver.start()
        try:
            for i in range(n):
                sent[i] = time.monotonic()
                theirs.send(i.to_bytes(4, "big") * 100)
                time.sleep(0.002)
            receiver.join(30)
            got = [(i, t - sent[i]) for i, t in arrived]
        finally:
            os.close(stop_w)
            worker.join(10)
            os.close(stop_r)
            ours.close()
            theirs.close()
        assert not worker.is_alive(), "forward() did not return at the lifeline's EOF"
        return got, result

    got, stats = run(0.03, 0.0, 40)
    assert [i for i, _ in got] == list(range(40))  # all of them, in order
    delays = sorted(d for _, d in got)
    assert delays[0] >= 0.03, delays[:3]
    assert delays[len(delays) // 2] < 0.045, delays  # median: delay + wake-up latency
    assert stats["packets"] == 40 and stats["dropped"] == 0, stats
    got, stats = run(0.001, 0.3, 300)
    assert 60 <= stats["dropped"] <= 120, stats  # Binomial(300, 0.3): mean 90, sd 8
    assert len(got) == 300 - stats["dropped"]
    assert [i for i, _ in got] == sorted(i for i, _ in got)


@needs_cluster
def test_delay_20ms_gives_a_40ms_round_trip_and_leaves_nothing_behind():
    """2x1 at 100 Mbit/s with 20 ms one way: a UDP ping-pong between the nodes takes
    40-60 ms, by netem or, without it, the TUN delay line; after the block no namespace,
    TUN device or forwarder is left. Negative control: delay 0 builds the plain bridge
    (no forwarder) and the round trip stays under 5 ms, so the bound above can fail."""
    tuns_before = _tun_devices()
    with netsim.two_tier(nodes=2, ranks_per_node=1, rate_mbit=100, delay_ms=20) as cluster:
        assert cluster.delay_applied and cluster.delay_mechanism in ("netem", "delayline"), \
            cluster.why
        rtt = cluster.measure_rtt(0, 1, count=15)
        names = set(cluster._namespaces)
        pid = cluster._forwarder.pid if cluster._forwarder else None
        if cluster.delay_mechanism == "delayline":
            assert "TUN delay line" in cluster.why, cluster.why
            assert _alive(pid)
            hub_tuns = subprocess.run(["ip", "-n", cluster.hub, "-o", "link", "show", "type",
                                       "tun"], capture_output=True, text=True).stdout
            assert f"{netsim.DELAY_DEV}:" in hub_tuns, hub_tuns
            assert cluster.delay_line_stats()["packets"] >= 2 * 15
    assert 40 <= rtt["rtt_ms"] < 60, rtt
    assert not names & _namespaces() and not netsim.leftovers_of(cluster.tag)
    assert pid is None or not _alive(pid), "the delay line outlived the cluster"
    assert _tun_devices() == tuns_before
    with netsim.two_tier(nodes=2, ranks_per_node=1, rate_mbit=100, delay_ms=0) as cluster:
        assert cluster.delay_mechanism is None and cluster._forwarder is None
        free = cluster.measure_rtt(0, 1, count=15)
    assert free["rtt_ms"] < 5, free


CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import netsim
with netsim.two_tier(nodes=2, ranks_per_node=1, rate_mbit=100, delay_ms=5) as cluster:
    pid = cluster._forwarder.pid if cluster._forwarder else 0
    print(cluster.tag, pid, flush=True)
    time.sleep(60)
"""


@needs_cluster
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_delay_line_ends_with_its_cluster(how):
    """SIGTERM to the process holding the cluster unwinds the ``with`` block: namespaces
    and forwarder are gone. SIGKILL runs no teardown (namespaces stay; removed here), but
    the forwarder still ends: its standard input, a pipe from the killed parent, closes."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, os.path.dirname(netsim.__file__)],
                            stdout=subprocess.PIPE, text=True)
    try:
        tag, pid = proc.stdout.readline().split()
        pid = int(pid)
        if not pid:
            pytest.skip("this kernel has netem: no delay line to end")
        assert _alive(pid) and netsim.leftovers_of(tag)
        proc.send_signal(getattr(signal, how))
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), f"the delay line outlived its parent's {how}"
        if how == "SIGTERM":
            assert proc.returncode == 128 + signal.SIGTERM
            assert not netsim.leftovers_of(tag)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if "tag" in locals():  # SIGKILL ran no teardown: remove what the child built
            for ns in netsim.leftovers_of(tag):
                subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
            for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{tag}-*")):
                shutil.rmtree(path, ignore_errors=True)


AFFINITY = r"""
import json, os, sys
from mpi4py import MPI
with open(os.path.join(sys.argv[1], f"{MPI.COMM_WORLD.Get_rank()}.json"), "w") as fh:
    json.dump(sorted(os.sched_getaffinity(0)), fh)
"""


@needs_cluster
@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")
def test_cpus_pin_each_nodes_ranks(tmp_path):
    """``cpus=[0, 1]``: node 0's rank runs on CPU 0 only, node 1's on CPU 1 only (the
    launcher wrapper's ``taskset -c``); a bad CPU list is refused before anything is
    built."""
    script = tmp_path / "affinity.py"
    script.write_text(AFFINITY)
    with netsim.two_tier(nodes=2, ranks_per_node=1, rate_mbit=None, cpus=[0, 1]) as cluster:
        assert "pinned" in cluster.why
        assert cluster.mpiexec([sys.executable, str(script), str(tmp_path)], timeout=60) == 0
    assert [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)] == [[0], [1]]
    with pytest.raises(ValueError, match="one CPU list per node"):
        with netsim.two_tier(nodes=2, ranks_per_node=1, cpus=[0]):
            pass
    with pytest.raises(ValueError, match="subset of this process's affinity"):
        with netsim.two_tier(nodes=2, ranks_per_node=1, cpus=[0, 4096]):
            pass
