"""Network emulation for the benchmarks: a rate-limited loopback, and a two-tier cluster.

**One shared link** (:func:`shaped_namespace`, :func:`run_limited`): every rank behind one
shaped loopback; described in :mod:`netsim_link`.

**Two-tier cluster** (:func:`two_tier`): ``nodes`` emulated hosts of ``ranks_per_node``
ranks each. Ranks of one node share memory (MPICH's shared-memory transport, commlib's
``_node()``); ranks of different nodes talk TCP over an emulated network::

    with two_tier(nodes=2, ranks_per_node=2, rate_mbit=1000) as cluster:
        print(cluster.measure_bandwidth())        # {"mbit": 941.3, "rtt_ms": 0.09, ...}
        status = cluster.mpiexec([sys.executable, "train.py"], timeout=600)
        # or run your own: subprocess.run(cluster.prefix() + argv, env=cluster.env)

**Delay and loss.** With the ``netem`` qdisc (:func:`has_netem`) each node's ``eth0``
gets ``netem delay <delay_ms> [loss <loss_pct>%]`` under its HTB class: one-way delay
``delay_ms``, round trip 2x. A kernel built without netem (``CONFIG_NET_SCH_NETEM`` unset,
as on our benchmark VM, which has only the pfifo, tbf and htb qdiscs and no ingress, ifb
or tc-bpf either) cannot hold a packet in the kernel, so the cluster is **routed through a
userspace delay line** instead (:mod:`delayline`; :attr:`Cluster.delay_mechanism` is
``"delayline"`` and :attr:`Cluster.why` says so)::

      node0 ns                         hub ns                          node1 ns
    +-----------+  veth   +----------------------------------+  veth  +-----------+
    | eth0      |=========| port0                      port1 |========| eth0      |
    | 10.13.0.1 |  HTB    |   |  ip rule iif port<i>     ^   |  HTB   | 10.13.0.2 |
    | HTB up    |  down   |   v  -> table 100            |   |  down  | HTB up    |
    +-----------+         |  dl0 (TUN) ==> forwarder ==> dl0 |        +-----------+
                          |  read, hold delay_ms, write back |
                          |  br0 10.13.0.254/32 (no ports)   |
                          +----------------------------------+

The veths and both HTB classes stay exactly as in the bridged layout (each node's link
full duplex at ``rate_mbit``); only the hub changes from a bridge to a router. Each node
keeps ``10.13.0.<i+1>/24`` on ``eth0`` (what MPI and gloo see) but without the on-link
prefix route: the /24 is routed via the hub (10.13.0.254). In the hub, ``ip_forward`` is
on, each node has a /32 route to its port, and a rule per port (``iif port<i> lookup
100``) sends every packet that *arrives from a node* to the TUN device ``dl0``; the
forwarder process (``ip netns exec <hub> python delayline.py``, started by the cluster
and ended at teardown) holds each packet ``delay_ms`` and writes it back into ``dl0``,
from where the main table routes it to the destination's port. So every node-to-node
packet (MPI, gloo, anything on ``eth0``) crosses the delay line once: one-way delay
``delay_ms``, round trip 2x, as with netem. Traffic to and from the hub itself (hydra's
control connections, ARP) is not delayed; ranks of one node (shared memory, loopback)
never leave the node. If the forwarder dies, ``dl0`` disappears with it and a blackhole
route in table 100 drops node-to-node traffic rather than delivering it undelayed.
``loss_pct`` without netem is Bernoulli loss per MTU packet in the forwarder (it then runs
without offloads: see :mod:`delayline`). With ``delay_ms`` and ``loss_pct`` both 0 (or
``None``) nothing of this exists: the bridged layout is built unchanged.

The parts: :mod:`netsim_link` (constants, capability checks, the one shared link),
:mod:`netsim_cluster` (the cluster, its launcher and its ``mpiexec``),
:mod:`netsim_shaping` (HTB, netem, TCP buffers), :mod:`netsim_delay` (the delay line's
hookup and its measurements), :mod:`netsim_measure` (bandwidth, round trip, TCP stream)
and :mod:`netsim_probes` (the processes behind the measurements). This module re-exports
their public names (``import netsim``) and is the command line:

``python benchmarks/netsim.py --nodes 2 --ranks-per-node 2 --rate 1000`` builds a cluster,
prints its measured bandwidth and topology, and tears it down; ``--delay 25`` adds 25 ms
one way (``--cpus 0/1`` pins the nodes), and the output then also has a UDP ping-pong
round trip, one TCP stream's rate and the delay line's CPU time
(:meth:`Cluster.measure_rtt`, :meth:`Cluster.measure_tcp`,
:meth:`Cluster.delay_line_stats`).
"""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Iterator, Sequence

from netsim_cluster import _WRAPPER, Cluster, _cpu_set, _cpu_specs  # noqa: F401
from netsim_link import (  # noqa: F401
    CLUSTER_ENV,
    DELAY_DEV,
    DELAY_TABLE,
    DELAYLINE,
    DELAYLINE_LOSS_MAX_MBIT,
    DELAYLINE_MAX_MBIT,
    HUB_ADDR,
    MPICH_TCP,
    NS_PREFIX,
    PROBES,
    SUBNET,
    TUNE_TCP_BUFFERS,
    _sh,
    _sysctl,
    can_build_cluster,
    can_delay_line,
    can_shape,
    has_netem,
    leftovers,
    leftovers_of,
    run_limited,
    shaped_namespace,
)


@contextlib.contextmanager
def two_tier(nodes: int = 2, ranks_per_node: int = 2, rate_mbit: float | None = 1000,
             delay_ms: float = 0.0, loss_pct: float = 0.0,
             cpus: Sequence | None = None) -> Iterator[Cluster]:
    """Build a two-tier cluster (see the module docstring) for the ``with`` block; it is
    torn down on every exit. ``rate_mbit``: each node's link rate in each direction
    (``None``: unlimited); ``delay_ms``: one-way delay between two nodes (round trip: 2x;
    netem on each node's upload, else the TUN delay line in the hub); ``loss_pct``: packet
    loss on each node's upload (netem) or per packet in the delay line; ``cpus``: one entry
    per node (``0``, ``[2, 3]`` or ``"2-3"``): that node's launcher, proxy and ranks run
    under ``taskset -c`` with it."""
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"two_tier: nodes and ranks_per_node must be >= 1, got {nodes}, "
                         f"{ranks_per_node}")
    if (delay_ms or 0) < 0 or not 0 <= (loss_pct or 0) < 100:
        raise ValueError(f"two_tier: expected delay_ms >= 0 and 0 <= loss_pct < 100, got "
                         f"{delay_ms}, {loss_pct}")
    cluster = Cluster(nodes, ranks_per_node, rate_mbit, delay_ms, loss_pct,
                      _cpu_specs(cpus, nodes))
    previous = None
    if hasattr(signal, "SIGTERM") and _main_thread():
        def terminate(signum, frame):  # noqa: ARG001 - SIGTERM unwinds like Ctrl-C
            raise SystemExit(128 + signum)
        previous = signal.signal(signal.SIGTERM, terminate)
    try:
        cluster._build()
        yield cluster
    finally:
        cluster._teardown()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build a two-tier cluster, measure it, tear it down.")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--rate", type=float, default=1000, help="Mbit/s per node link; 0: none")
    p.add_argument("--delay", type=float, default=0.0, help="one-way ms")
    p.add_argument("--loss", type=float, default=0.0, help="percent")
    p.add_argument("--cpus", help="one taskset -c list per node, separated by '/': "
                   "'0/1' pins node 0 to CPU 0 and node 1 to CPU 1")
    p.add_argument("--seconds", type=float, default=4.0, help="TCP stream probe length")
    p.add_argument("--nbytes", type=int, default=16 << 20)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    cpus = args.cpus.split("/") if args.cpus else None
    with two_tier(args.nodes, args.ranks_per_node, args.rate or None, args.delay,
                  args.loss, cpus=cpus) as cluster:
        print(f"netsim: {cluster.why}")
        if args.nodes > 1 and cluster.shaped:
            print("between nodes 0 and 1, UDP ping-pong:", cluster.measure_rtt(0, 1))
            print("between nodes 0 and 1, one TCP stream:",
                  cluster.measure_tcp(0, 1, seconds=args.seconds))
        if args.nodes > 1:
            print("between nodes 0 and 1, MPI:", cluster.measure_bandwidth(
                0, 1, nbytes=args.nbytes))
        if cluster.delay_mechanism == "delayline":
            print("delay line so far:", cluster.delay_line_stats())
        if args.ranks_per_node > 1:
            print("inside node 0:", cluster.measure_bandwidth(0, 0, nbytes=args.nbytes))
        cluster.mpiexec([sys.executable, "-m", "commlib.tools.info"], timeout=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
