"""The two-tier cluster emulation of ``benchmarks/netsim.py``: shaped inter-node rate,
separate hosts with shared memory inside each, and clean teardown (serial: each test
builds its own cluster of namespaces and runs ``mpiexec`` inside it). Needs root, ``ip``,
``tc`` and bridge/veth support; skipped otherwise."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import netsim  # noqa: E402

OK, WHY = netsim.can_build_cluster()
pytestmark = pytest.mark.skipif(not OK, reason=f"no two-tier emulation here: {WHY}")

PROBE_BYTES = 4 << 20  # 0.34 s at 100 Mbit/s


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


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
from commlib.mpi_env import _node
from mpi4py import MPI
commlib.init()
local_rank, local_size = _node(MPI.COMM_WORLD)
with open(os.path.join(sys.argv[1], f"{commlib.get_rank()}.json"), "w") as fh:
    json.dump({"host": socket.gethostname(), "local_size": local_size,
               "local_rank": local_rank, "local_world": os.environ.get("LOCAL_WORLD_SIZE"),
               "master": os.environ.get("MASTER_ADDR")}, fh)
"""


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


def test_teardown_after_exception():
    with pytest.raises(KeyboardInterrupt):
        with netsim.two_tier(nodes=2, ranks_per_node=1, rate_mbit=100) as cluster:
            names = set(cluster._namespaces)
            assert len(names) == 3 and names <= _namespaces()
            raise KeyboardInterrupt
    assert not names & _namespaces()


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
