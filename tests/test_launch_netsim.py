"""torchrun ``--nnodes 2`` on the emulated two-tier cluster (``benchmarks/netsim.py``): one
torchrun agent per emulated node (its own network namespace and hostname), the c10d
rendezvous on node 0's address, 2 workers per agent. commlib's store-backed world
(``commlib.mpi.launch``) must make them one MPI world of 4 whose nodes are the emulated ones
(2 local ranks each), MPICH's inter-node traffic over TCP between the namespaces, gloo beside
it, and training in ``launch_program.py`` as on one host. Negative control: the same agents
with a rendezvous that names a third agent never started (``--nnodes 3``) form no world and
fail within their rendezvous timeout, instead of training alone.

Needs root, ``ip``, ``tc`` and bridges (the cluster says why otherwise, and the test skips).
Serial session only.
"""
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest

from helpers import serial_only
from test_launch import PROGRAM, base_env, check_job, free_port

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import netsim  # noqa: E402

pytestmark = serial_only
OK, WHY = netsim.can_build_cluster()


def agents(cluster, nnodes: int, timeout: float, extra_conf: str = "") -> tuple:
    """Start one torchrun agent on each emulated node; (statuses, combined output)."""
    port = free_port()
    env = dict(base_env(), **netsim.CLUSTER_ENV)
    procs = []
    for i in range(cluster.nodes):
        # The emulated nodes have hostnames but no DNS: node 0 is told that it hosts the
        # rendezvous store, and each agent publishes its address rather than its name
        # (--local-addr), as on a cluster whose hostnames do not resolve.
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
               "--nproc-per-node=2", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={netsim.SUBNET}.1:{port}", "--rdzv-id=netsim",
               f"--rdzv-conf=is_host={int(i == 0)}{extra_conf}",
               f"--local-addr={netsim.SUBNET}.{i + 1}", "--monitor-interval=0.5",
               PROGRAM, "store"]
        procs.append(subprocess.Popen([cluster._wrapper, f"node{i}", shlex.join(cmd)],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env, start_new_session=True))
    codes, outs = [], []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
            codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            outs.append(p.communicate()[0])
            codes.append(-9)
    return codes, "".join(outs)


@pytest.mark.skipif(not OK, reason=f"no emulated cluster here: {WHY}")
def test_torchrun_two_nodes_on_the_emulated_cluster():
    with netsim.two_tier(nodes=2, ranks_per_node=2, rate_mbit=1000) as cluster:
        assert cluster.shaped, cluster.why
        codes, out = agents(cluster, 2, 300)
        assert codes == [0, 0], out[-4000:]
        check_job(out, 4)
        # two emulated nodes of two ranks each: MPI saw the namespaces' hostnames
        assert sorted(re.findall(r"rank \d of 4 ok \S+ local=(\d+/\d+)", out)) == \
            ["0/2", "0/2", "1/2", "1/2"], out[-4000:]
        # negative control: a rendezvous waiting for a third node never forms a world
        codes, out = agents(cluster, 3, 120, ",join_timeout=15")
        assert all(c != 0 for c in codes), out[-4000:]
        assert not re.search(r"rank \d of \d ok", out), out[-4000:]
