"""Network emulation for the benchmarks: a rate-limited loopback, and a two-tier cluster.

**One shared link** (:func:`shaped_namespace`, :func:`run_limited`): a Linux network
namespace whose loopback is shaped with an HTB class of the given rate (``tc``); MPICH is
forced onto TCP over that loopback:
``MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp MPIR_CVAR_CH4_SHM_ENABLE=0 MPIR_CVAR_NOLOCAL=1``
(all four are needed: without the netmod setting large messages bypass the limit). gloo,
which uses TCP on loopback anyway, is limited too. The limit applies to the whole
namespace: all ranks share ONE link of that rate, like ranks behind one switch port.

**Two-tier cluster** (:func:`two_tier`): ``nodes`` emulated hosts of ``ranks_per_node``
ranks each. Ranks of one node share memory (MPICH's shared-memory transport, commlib's
``_node()``); ranks of different nodes talk TCP over an emulated network::

    with two_tier(nodes=2, ranks_per_node=2, rate_mbit=1000) as cluster:
        print(cluster.measure_bandwidth())        # {"mbit": 941.3, "rtt_ms": 0.09, ...}
        status = cluster.mpiexec([sys.executable, "train.py"], timeout=600)
        # or run your own: subprocess.run(cluster.prefix() + argv, env=cluster.env)

How it is built (root, ``ip``, ``tc``): a hub namespace holds a Linux bridge ``br0``
(10.13.0.254/24); every node is a namespace with a veth ``eth0`` (10.13.0.<i+1>/24) whose
other end is a port of the bridge. Both ends of every veth carry an HTB class of
``rate_mbit`` (the node's upload on its ``eth0``, its download on the bridge port), so a
node's link is full duplex at that rate in each direction, like a NIC on a switch; node
pairs do not share a link, only a node's own port. ``mpiexec`` runs in the hub namespace
(``-iface br0``: the proxies reach its control port over the bridge) and starts one
``hydra_pmi_proxy`` per node with ``-launcher ssh -launcher-exec <wrapper>``: hydra calls
``wrapper -x node<i> "<proxy command>"`` and the wrapper runs the command as
``ip netns exec <node ns> unshare --uts`` after setting the host name to ``node<i>``, so
MPI, commlib (``socket.gethostname``) and torch see separate hosts. The environment
(:attr:`Cluster.env`) sends MPICH's inter-node traffic over TCP on ``eth0``
(``MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=eth0``) while ranks of one node
keep shared memory; gloo is pinned to ``eth0`` (``GLOO_SOCKET_IFNAME``), and
``MASTER_ADDR`` comes from commlib's env publishing (node 0's 10.13.0.1), so torch DDP
over gloo crosses the shaped links too.

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

With any delay (netem or delay line) the node namespaces' ``net.ipv4.tcp_rmem``/
``tcp_wmem`` maxima are raised to 4 bandwidth-delay products when that is above the
defaults (per-namespace sysctls; see :meth:`Cluster._tcp_buffers`).

The forwarder runs at ``SCHED_FIFO`` priority 1 where allowed (said in :attr:`Cluster.why`)
on any CPU: it is the wire, its timing should not depend on how busy the ranks keep the
cores (MPICH's ranks spin while they wait), and it needs little CPU. At normal priority,
with both cores busy, it added 2-12 ms to an MPI round trip and two 1 Gbit/s streams in
opposite directions reached only 0.35-0.55 Gbit/s each; at ``SCHED_FIFO`` 1 both reach
0.95 Gbit/s (below). The kernel's real-time throttling (95 % of each second) still bounds
it. It is not pinned: with one rank per core there is no idle core to give it, and pinning
it to one would always preempt the same rank.

Measured on the development machine (2 vCPUs shared with other sessions' test runs, load
average 13-15: noisy; medians of 3 runs, 2 for the bidirectional rows; 2 nodes x 1 rank,
UDP ping-pong of :meth:`Cluster.measure_rtt`, one 4 s TCP stream of
:meth:`Cluster.measure_tcp`, MPI of :meth:`Cluster.measure_bandwidth`)::

    delay (one way)   UDP RTT    MPI ping-pong RTT   (100 Mbit/s)
    0 (bridge)        0.03 ms    0.02-10 ms (spinning ranks on 2 loaded cores)
    10 ms             20.5 ms    27.7 ms
    25 ms             50.6 ms    53.6 ms
    50 ms             100.6 ms   104.9 ms

    rate        delay   TCP stream   MPI probe*   forwarder CPU   bytes per read
    10 Mbit/s   0       9.55         9.53         -               -
    10 Mbit/s   25 ms   9.56         9.54         43 ms/MB        1.5 KB
    100 Mbit/s  0       95.6         95.9         -               -
    100 Mbit/s  25 ms   95.7         92.1         7.4 ms/MB       6.6 KB
    1 Gbit/s    0       942          948          -               -
    1 Gbit/s    25 ms   941          840          1.4 ms/MB       39 KB
    1 Gbit/s    25 ms, Linux's default tcp_wmem max (4 MiB): 424 (MPI 439)
    * one-way MPI_Send of 2 MiB at 10 Mbit/s, 16 MiB at 100 Mbit/s, 64 MiB at 1 Gbit/s
    both ways at once, 25 ms: 100 Mbit/s 94 + 94, 300 Mbit/s 286 + 286,
    1 Gbit/s 954 + 955 (forwarder 20-30 % of a core); no limit: one stream 1.3-2.8 Gbit/s

So the forwarder's CPU per MB falls with the rate (TCP sends larger bursts, which the hub
hands over as one super-packet): about 5 % of a core at 10 Mbit/s, 10 % at 100 Mbit/s and
15-30 % at 1 Gbit/s each way. It keeps the configured rate up to 2 nodes x 1 Gbit/s both
ways (``DELAYLINE_MAX_MBIT`` = 2000 in total); above that, or without a rate limit, the
cluster warns and says in :attr:`Cluster.why` that the forwarder, not HTB, may set the rate.
Linux's autotuning reaches 100 Mbit/s through a 50 ms round trip (bandwidth-delay product
625 KB, far below the 4 MiB ``tcp_wmem`` maximum), but not 1 Gbit/s (6.25 MB): hence the
raised maxima above.

**CPU pinning** (``two_tier(..., cpus=[0, 1])``): node ``i``'s launcher wrapper runs the
proxy under ``taskset -c <cpus[i]>``, so that node's ranks (and their threads) inherit
that CPU set; on a 2-core machine ``cpus=[0, 1]`` gives a 2x1 job one core per rank. The
delay line's forwarder is not pinned (see above). A 2-rank MPI allreduce of 8 bytes across
a 25 ms link takes one one-way delay, not a round trip (MPICH exchanges the two
contributions at once): measured 28-29 ms per call in a loop and 35-44 ms from a
simultaneous start (median; ranks pinned, 100 Mbit/s).

Names are unique per cluster (``cl<hex>-hub``, ``cl<hex>-node<i>``; nothing is created in
the root namespace), and everything is deleted on every exit path of the ``with`` block
(exception, Ctrl-C, SIGTERM). Without root, ``ip``, ``tc`` or bridge support the cluster
says why and runs unshaped on one host, nodes simulated with
``COMMLIB_LOCAL_SIZE=ranks_per_node`` (still a valid MPI job).

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
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
import warnings
from collections.abc import Iterator, Sequence

MPICH_TCP = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp",
             "MPIR_CVAR_CH4_SHM_ENABLE": "0", "MPIR_CVAR_NOLOCAL": "1"}
# Inter-node traffic over TCP on eth0; shared memory inside a node stays on.
CLUSTER_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0",
               "FI_SOCKETS_IFACE": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}
SUBNET = "10.13.0"
HUB_ADDR = f"{SUBNET}.254"
NS_PREFIX = "cl"
DELAY_TABLE = "100"  # the hub's routing table (and rule preference) towards the delay line
DELAY_DEV = "dl0"  # the hub's TUN device
DELAYLINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delayline.py")
# the measurements' own processes (an MPI point-to-point probe, UDP and TCP socket probes)
PROBES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netsim_probes.py")
# Highest total rate (Mbit/s: the sum of every node's upload, nodes x rate_mbit) the delay
# line is measured to carry at the configured rate on the development machine (2 nodes at
# 1000 Mbit/s both ways at once; see the module docstring); above it the cluster warns.
DELAYLINE_MAX_MBIT = 2000
# With delay, raise the node namespaces' TCP buffer maxima to 4 bandwidth-delay products
# (Cluster._tcp_buffers); False only to measure what Linux's defaults do.
TUNE_TCP_BUFFERS = True
# with loss: no offloads, one MTU packet per read (measured: 2 x 10 Mbit/s, 1% loss)
DELAYLINE_LOSS_MAX_MBIT = 20


def can_shape() -> tuple[bool, str]:
    """Whether namespaces and tc are usable here, and why not."""
    if os.geteuid() != 0:
        return False, "not root: network namespaces need CAP_SYS_ADMIN"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            return False, f"'{tool}' (iproute2) is not installed"
    return True, "root with ip and tc"


def _sh(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"netsim: {' '.join(cmd)} failed: {done.stderr.strip()}")


@contextlib.contextmanager
def shaped_namespace(rate_mbit: float | None) -> Iterator[list[str]]:
    """Yield the command prefix that runs inside a namespace whose loopback is limited to
    ``rate_mbit`` Mbit/s (``None``: unlimited, still TCP in a namespace, for comparability)."""
    ok, why = can_shape()
    if not ok:
        print(f"netsim: {why}; running without a bandwidth limit", flush=True)
        yield []
        return
    name = f"commlib-{uuid.uuid4().hex[:8]}"
    _sh("ip", "netns", "add", name)
    try:
        _sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        if rate_mbit is not None:
            rate = f"{rate_mbit}mbit"
            _sh("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root",
                "handle", "1:", "htb", "default", "10")
            _sh("ip", "netns", "exec", name, "tc", "class", "add", "dev", "lo", "parent",
                "1:", "classid", "1:10", "htb", "rate", rate, "ceil", rate)
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def run_limited(rate_mbit: float | None, argv: list[str], timeout: float) -> int:
    """Run ``argv`` (e.g. an mpiexec command line) under the limit, MPICH on TCP."""
    env = dict(os.environ, **MPICH_TCP)
    with shaped_namespace(rate_mbit) as prefix:
        return subprocess.run(prefix + argv, env=env, timeout=timeout).returncode


# -- two-tier cluster ----------------------------------------------------------------------

def can_build_cluster() -> tuple[bool, str]:
    """Whether :func:`two_tier` can build namespaces, veths, a bridge and HTB here."""
    ok, why = can_shape()
    if not ok:
        return ok, why
    if subprocess.run(["which", "unshare"], capture_output=True).returncode:
        return False, "'unshare' (util-linux) is not installed"
    probe = f"{NS_PREFIX}{uuid.uuid4().hex[:6]}-probe"
    try:
        _sh("ip", "netns", "add", probe)
        _sh("ip", "netns", "exec", probe, "ip", "link", "add", "br0", "type", "bridge")
        _sh("ip", "netns", "exec", probe, "ip", "link", "add", "name", "pa", "type", "veth",
            "peer", "name", "pb")
    except RuntimeError as exc:
        return False, f"no bridge/veth support ({exc})"
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return True, "root with ip, tc, unshare, bridge and veth"


def has_netem() -> bool:
    """Whether the kernel has the netem qdisc (delay, loss)."""
    probe = f"{NS_PREFIX}{uuid.uuid4().hex[:6]}-probe"
    try:
        _sh("ip", "netns", "add", probe)
        _sh("ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up")
        _sh("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
            "delay", "1ms")
        return True
    except RuntimeError:
        return False
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True)


def can_delay_line() -> tuple[bool, str]:
    """Whether the TUN delay line (:mod:`delayline`) can run here, and why not."""
    if not os.path.exists("/dev/net/tun"):
        return False, "no /dev/net/tun for the TUN delay line"
    if subprocess.run(["which", "sysctl"], capture_output=True).returncode:
        return False, "'sysctl' (procps) is not installed: the hub cannot route"
    return True, "TUN delay line"


def _sysctl(where: Sequence[str], key: str) -> str:
    done = subprocess.run([*where, "sysctl", "-n", key], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"netsim: sysctl {key} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def leftovers() -> list[str]:
    """Namespaces of clusters (this module's names) that exist now."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(NS_PREFIX) and ("-hub" in n or "-node" in n
                                                            or "-probe" in n)]


def leftovers_of(tag: str) -> list[str]:
    """Namespaces of the cluster ``tag`` (:attr:`Cluster.tag`) that exist now."""
    return [n for n in leftovers() if n.startswith(f"{tag}-")]


_WRAPPER = """#!/bin/sh
# hydra's ssh launcher calls: wrapper [-x] HOST "COMMAND ARGS..."
[ "$1" = "-x" ] && shift
host="$1"; shift
pin=""
case "$host" in
{pins}esac
exec $pin ip netns exec "{tag}-$host" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
"""


class Cluster:
    """A running two-tier cluster (see the module docstring); made by :func:`two_tier`.

    ``shaped``: whether nodes are real namespaces (else one host, ``COMMLIB_LOCAL_SIZE``
    simulation); ``why``: what was built and what was not applied; ``delay_mechanism``:
    ``"netem"``, ``"delayline"`` (the TUN forwarder) or ``None`` (no delay or loss
    applied); ``cpus``: each node's CPU list for ``taskset -c`` (``None``: not pinned)."""

    def __init__(self, nodes: int, ranks_per_node: int, rate_mbit: float | None,
                 delay_ms: float, loss_pct: float,
                 cpus: Sequence[str] | None = None) -> None:
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        self.rate_mbit, self.delay_ms, self.loss_pct = rate_mbit, delay_ms, loss_pct
        self.cpus = list(cpus) if cpus is not None else None
        self.tag = f"{NS_PREFIX}{uuid.uuid4().hex[:6]}"
        self.shaped, self.why = False, ""
        self.delay_applied = False
        self.delay_mechanism: str | None = None
        self.hosts = [f"node{i}" for i in range(nodes)]
        self._dir: str | None = None
        self._namespaces: list[str] = []
        self._forwarder: subprocess.Popen | None = None
        self.env: dict[str, str] = {}

    # -- building ---------------------------------------------------------------------------
    @property
    def hub(self) -> str:
        return f"{self.tag}-hub"

    def namespace(self, node: int) -> str:
        """The network namespace of node ``node``."""
        return f"{self.tag}-node{node}"

    def _build(self) -> None:
        ok, why = can_build_cluster()
        base = {k: v for k, v in os.environ.items() if k != "COMMLIB_LOCAL_SIZE"}
        if not ok:
            self.why = f"{why}: unshaped, one host, COMMLIB_LOCAL_SIZE={self.ranks_per_node}"
            if self.cpus is not None:
                self.why += "; cpus NOT applied (no per-node launcher)"
            print(f"netsim: {self.why}", flush=True)
            self.env = dict(base, COMMLIB_LOCAL_SIZE=str(self.ranks_per_node))
            return
        impaired = bool(self.delay_ms or self.loss_pct)
        netem = has_netem() if impaired else False
        line, line_why = (False, "")
        if impaired and not netem:
            line, line_why = can_delay_line()
        self._dir = tempfile.mkdtemp(prefix=f"{self.tag}-")
        wrapper = os.path.join(self._dir, "nsexec")
        pins = "".join(f"  node{i}) pin=\"taskset -c {c}\" ;;\n"
                       for i, c in enumerate(self.cpus or []))
        with open(wrapper, "w") as fh:
            fh.write(_WRAPPER.format(tag=self.tag, pins=pins))
        os.chmod(wrapper, 0o755)
        self._wrapper = wrapper
        hub = self.hub
        _sh("ip", "netns", "add", hub)
        self._namespaces.append(hub)
        inhub = ("ip", "netns", "exec", hub)
        _sh(*inhub, "ip", "link", "set", "lo", "up")
        _sh(*inhub, "ip", "link", "add", "br0", "type", "bridge")
        # routed (delay line): br0 keeps the hub's address for hydra's -iface, no ports
        _sh(*inhub, "ip", "addr", "add", f"{HUB_ADDR}/{32 if line else 24}", "dev", "br0")
        _sh(*inhub, "ip", "link", "set", "br0", "up")
        if line:
            _sh(*inhub, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            _sh(*inhub, "sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0")
            _sh(*inhub, "sysctl", "-qw", "net.ipv4.conf.default.rp_filter=0")
        for i in range(self.nodes):
            ns = self.namespace(i)
            _sh("ip", "netns", "add", ns)
            self._namespaces.append(ns)
            port = f"port{i}"
            addr = f"{SUBNET}.{i + 1}"
            _sh("ip", "link", "add", "name", port, "netns", hub, "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            if not line:
                _sh(*inhub, "ip", "link", "set", port, "master", "br0")
            _sh(*inhub, "ip", "link", "set", port, "up")
            innode = ("ip", "netns", "exec", ns)
            _sh(*innode, "ip", "link", "set", "lo", "up")
            if line:
                # same address and netmask (what MPI and gloo see), but every other node is
                # reached through the hub's router instead of on the link
                _sh(*innode, "ip", "addr", "add", f"{addr}/24", "dev", "eth0", "noprefixroute")
                _sh(*innode, "ip", "link", "set", "eth0", "up")
                _sh(*innode, "ip", "route", "add", f"{HUB_ADDR}/32", "dev", "eth0")
                _sh(*innode, "ip", "route", "add", f"{SUBNET}.0/24", "via", HUB_ADDR,
                    "dev", "eth0")
                _sh(*inhub, "ip", "route", "add", f"{addr}/32", "dev", port)
                _sh(*inhub, "ip", "rule", "add", "iif", port, "lookup", DELAY_TABLE,
                    "pref", DELAY_TABLE)
            else:
                _sh(*innode, "ip", "addr", "add", f"{addr}/24", "dev", "eth0")
                _sh(*innode, "ip", "link", "set", "eth0", "up")
            if netem or line:
                self._tcp_buffers(innode)
            # upload: the node's eth0; download: the hub's port towards the node
            self._shape(innode, "eth0", netem)
            self._shape(inhub, port, False)
        if line:
            self._start_delay_line(inhub)
        self.delay_applied = netem or (line and bool(self.delay_ms))
        self.delay_mechanism = "netem" if netem else "delayline" if line else None
        parts = [f"{self.nodes} namespaces x {self.ranks_per_node} ranks "
                 + ("routed through the hub's TUN delay line" if line else "on a bridge")]
        parts.append(f"HTB {self.rate_mbit:g} Mbit/s each way per node" if self.rate_mbit
                     else "no rate limit")
        if netem:
            parts.append(f"netem delay {self.delay_ms} ms loss {self.loss_pct}%")
        elif line:
            parts.append(f"delay {self.delay_ms:g} ms one way (round trip {2 * self.delay_ms:g}"
                         f" ms) loss {self.loss_pct:g}% by the TUN delay line (userspace "
                         f"forwarder pid {self._forwarder.pid}, "
                         f"{self._forwarder_priority}, any CPU; the kernel has no netem)")
            parts.extend(self._delay_line_warnings())
        elif impaired:
            parts.append(f"delay {self.delay_ms} ms / loss {self.loss_pct}% NOT applied: the "
                         f"kernel has no netem qdisc (CONFIG_NET_SCH_NETEM) and {line_why}")
        if self.cpus is not None:
            parts.append("nodes pinned to CPUs " + ", ".join(
                f"node{i}: {c}" for i, c in enumerate(self.cpus)))
        self.why = "; ".join(parts)
        self.shaped = True
        self.env = dict(base, **CLUSTER_ENV, **self._thread_env(base))

    def _tcp_buffers(self, innode: Sequence[str]) -> None:
        """With delay, let TCP's autotuning grow to a few bandwidth-delay products: the
        round trip is 2 x ``delay_ms`` and the default ``tcp_wmem`` maximum (4 MiB) is
        below one BDP from ~650 Mbit/s at 50 ms. Per-namespace sysctls: only the nodes."""
        if not TUNE_TCP_BUFFERS:
            return
        rate = self.rate_mbit or 10000
        bdp = int(rate * 1e6 / 8 * 2 * self.delay_ms / 1e3)
        top = max(4 << 20, 4 * bdp)
        for key in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
            low, default, high = _sysctl(innode, key).split()
            if int(high) < top:
                _sh(*innode, "sysctl", "-qw", f"{key}={low} {default} {top}")

    def _thread_env(self, base: dict[str, str]) -> dict[str, str]:
        """Emulated nodes share this machine's cores, but each rank's launcher tells it how
        many ranks share *its* node (``MPI_LOCALNRANKS``), and commlib's kernels size
        Numba's pool from that: on 4x1 every rank took all the cores and their spinning
        workers made bytegrad and qadam steps 5-10x slower (272 against 48 ms, 346
        against 36 ms per step at 1 Gbit/s). Give each rank its share of the real cores
        (unless the caller chose)."""
        if self.cpus is not None:  # pinned: a node's ranks share that node's CPUs
            share = str(max(1, min(len(_cpu_set(c)) for c in self.cpus)
                            // self.ranks_per_node))
        else:
            try:
                cores = len(os.sched_getaffinity(0))
            except (AttributeError, OSError):
                cores = os.cpu_count() or 1
            share = str(max(1, cores // (self.nodes * self.ranks_per_node)))
        return {var: share for var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")
                if var not in base}

    def _shape(self, where: Sequence[str], dev: str, netem: bool) -> None:
        if self.rate_mbit:
            rate = f"{self.rate_mbit:g}mbit"
            # a burst of ~1 ms of traffic (at least 64 KiB) lets HTB reach high rates
            burst = str(max(65536, int(self.rate_mbit * 1e6 / 8 * 1e-3)))
            _sh(*where, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
                "default", "10")
            _sh(*where, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10",
                "htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst,
                "quantum", "200000")
            parent = ("parent", "1:10", "handle", "10:")
        else:
            parent = ("root",)
        if netem:
            extra = ["loss", f"{self.loss_pct}%"] if self.loss_pct else []
            _sh(*where, "tc", "qdisc", "add", "dev", dev, *parent, "netem", "delay",
                f"{self.delay_ms}ms", *extra, "limit", "100000")

    def _start_delay_line(self, inhub: Sequence[str]) -> None:
        """Start the forwarder in the hub (it creates ``dl0``), wait for its ``ready``
        line, then route every packet that arrives from a node's port into the device
        (table ``DELAY_TABLE``); a blackhole below that route drops the traffic if the
        device ever disappears, so it is never delivered undelayed."""
        log = open(os.path.join(self._dir, "delayline.log"), "w")
        argv = [*inhub, sys.executable, DELAYLINE, "--dev", DELAY_DEV,
                "--delay-ms", str(self.delay_ms or 0), "--loss-pct", str(self.loss_pct or 0)]
        self._forwarder = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=log, start_new_session=True)
        log.close()
        line = b""
        if select.select([self._forwarder.stdout], [], [], 15)[0]:
            line = self._forwarder.stdout.readline()
        if line.split() != [b"ready", DELAY_DEV.encode()]:
            with open(os.path.join(self._dir, "delayline.log")) as fh:
                err = fh.read().strip()
            raise RuntimeError(f"netsim: the delay line did not report 'ready {DELAY_DEV}' "
                               f"within 15 s (got {line!r}; stderr: {err!r})")
        self._forwarder_priority = "normal priority (SCHED_FIFO refused)"
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(self._forwarder.pid, os.SCHED_FIFO, os.sched_param(1))
            self._forwarder_priority = "SCHED_FIFO 1"
        _sh(*inhub, "ip", "link", "set", DELAY_DEV, "txqueuelen", "10000", "up")
        _sh(*inhub, "sysctl", "-qw", f"net.ipv4.conf.{DELAY_DEV}.rp_filter=0")
        _sh(*inhub, "ip", "route", "add", f"{SUBNET}.0/24", "dev", DELAY_DEV,
            "table", DELAY_TABLE)
        _sh(*inhub, "ip", "route", "add", "blackhole", f"{SUBNET}.0/24", "table", DELAY_TABLE,
            "metric", "1000")
        if self.delay_ms:
            # the router's own ICMP (redirects, errors) is not what a node's link would do
            _sh(*inhub, "sysctl", "-qw", "net.ipv4.conf.all.send_redirects=0")

    def _delay_line_warnings(self) -> list[str]:
        """Rates the forwarder is not known to sustain: said in :attr:`why` and warned."""
        out = []
        rate = self.rate_mbit
        if rate is None or rate * self.nodes > DELAYLINE_MAX_MBIT:
            load = "no rate limit" if rate is None else \
                f"{self.nodes} nodes x {rate:g} Mbit/s = {self.nodes * rate:g} Mbit/s"
            out.append(f"WARNING: {load} is above the {DELAYLINE_MAX_MBIT} Mbit/s in total "
                       f"the delay line is measured to carry: the forwarder, not HTB, may "
                       f"set the rate")
        if self.loss_pct and (rate is None or rate * self.nodes > DELAYLINE_LOSS_MAX_MBIT):
            out.append(f"WARNING: with loss the delay line forwards MTU-sized packets, "
                       f"measured only up to {DELAYLINE_LOSS_MAX_MBIT} Mbit/s in total")
        for text in out:
            warnings.warn(f"netsim: {text}", RuntimeWarning, stacklevel=5)
        return out

    def delay_line_stats(self) -> dict[str, float]:
        """The forwarder's CPU seconds so far (user + system, from ``/proc``) and what
        passed through ``dl0``: ``bytes``/``packets`` read by the forwarder,
        ``sent_bytes`` written back, ``queue_drops`` packets the kernel dropped because
        the device's queue was full (the forwarder did not keep up). Raises if this
        cluster has no delay line."""
        if self._forwarder is None:
            raise RuntimeError(f"netsim: no delay line in this cluster ({self.why})")
        with open(f"/proc/{self._forwarder.pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        out = subprocess.run(["ip", "-n", self.hub, "-s", "-j", "link", "show", DELAY_DEV],
                             capture_output=True, text=True, check=True).stdout
        counters = json.loads(out)[0]["stats64"]
        # the device's tx is what the kernel handed to the forwarder, rx what it wrote back
        return {"cpu_s": (int(fields[11]) + int(fields[12])) / tick,
                "bytes": counters["tx"]["bytes"], "packets": counters["tx"]["packets"],
                "sent_bytes": counters["rx"]["bytes"], "queue_drops": counters["tx"]["dropped"]}

    def _stop_delay_line(self) -> None:
        proc, self._forwarder = self._forwarder, None
        if proc is None:
            return
        for step in (proc.stdin.close, proc.terminate, proc.kill):
            with contextlib.suppress(OSError):
                step()
            try:
                proc.wait(timeout=3)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(OSError):
            proc.stdout.close()

    def _teardown(self) -> None:
        self._stop_delay_line()
        for ns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        self._namespaces.clear()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # -- running ----------------------------------------------------------------------------
    def prefix(self, hosts: Sequence[tuple[int, int]] | None = None) -> list[str]:
        """The ``mpiexec ... -n N`` command line (the program's argv goes after it), to
        run with :attr:`env`. ``hosts``: ``[(node, ranks), ...]`` (default: every node,
        ``ranks_per_node`` each, ranks placed node by node)."""
        hosts = list(hosts) if hosts is not None else \
            [(i, self.ranks_per_node) for i in range(self.nodes)]
        total = sum(n for _, n in hosts)
        mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep
                               + os.environ.get("PATH", "")) or "mpiexec"
        if not self.shaped:
            return [mpiexec, "-n", str(total)]
        spec = ",".join(f"node{i}:{n}" for i, n in hosts)
        return ["ip", "netns", "exec", self.hub, mpiexec, "-hosts", spec, "-launcher", "ssh",
                "-launcher-exec", self._wrapper, "-iface", "br0", "-n", str(total)]

    def mpiexec(self, argv: Sequence[str], timeout: float | None = None,
                hosts: Sequence[tuple[int, int]] | None = None,
                env: dict[str, str] | None = None, **kwargs) -> int:
        """Run ``argv`` on every rank of the cluster (see :meth:`prefix`); returns the exit
        status. ``env``: extra variables; ``kwargs`` go to ``subprocess.run``."""
        full = dict(self.env, **(env or {}))
        return subprocess.run(self.prefix(hosts) + list(argv), env=full, timeout=timeout,
                              **kwargs).returncode

    def measure_bandwidth(self, a: int = 0, b: int = 1, nbytes: int = 16 << 20,
                          reps: int = 3, timeout: float = 120) -> dict[str, float]:
        """Point-to-point between one rank on node ``a`` and one on node ``b`` (``a == b``:
        two ranks of one node): ``mbit`` = best of ``reps`` one-way transfers of ``nbytes``
        (Mbit/s, 1e6 bit), ``rtt_ms`` = median round trip of a 1-byte ping-pong."""
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
            out = fh.name
        try:
            hosts = [(a, 2)] if a == b else [(a, 1), (b, 1)]
            argv = [sys.executable, PROBES, "--probe", out,
                    "--nbytes", str(nbytes), "--reps", str(reps)]
            code = self.mpiexec(argv, timeout=timeout, hosts=hosts)
            if code:
                raise RuntimeError(f"netsim: bandwidth probe exited {code}")
            with open(out) as fh:
                return json.load(fh)
        finally:
            os.unlink(out)


    def _in_node(self, node: int, *args: str) -> list[str]:
        if not self.shaped:
            raise RuntimeError(f"netsim: socket probes need the node namespaces ({self.why})")
        return ["ip", "netns", "exec", self.namespace(node), sys.executable, PROBES, *args]

    def _serve_and_run(self, b: int, server: list[str], client: list[str],
                       timeout: float) -> tuple[str, str]:
        """Start ``server`` in node ``b`` and wait for its ``ready`` line, run ``client``
        (its own node), return both outputs; the server is ended on every path."""
        srv = subprocess.Popen(server, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
        try:
            if not select.select([srv.stdout], [], [], 15)[0] or \
                    srv.stdout.readline().strip() != "ready":
                raise RuntimeError(f"netsim: probe server {server} did not get ready: "
                                   f"{srv.stderr.read() if srv.poll() is not None else ''}")
            done = subprocess.run(client, capture_output=True, text=True, timeout=timeout)
            if done.returncode:
                raise RuntimeError(f"netsim: probe {client} exited {done.returncode}: "
                                   f"{done.stderr.strip()}")
            try:
                out = srv.communicate(timeout=timeout)[0]
            except subprocess.TimeoutExpired:
                out = ""
            return done.stdout, out
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.wait()

    def measure_rtt(self, a: int = 0, b: int = 1, count: int = 20,
                    timeout: float = 60) -> dict[str, float]:
        """UDP ping-pong (16-byte datagrams) from node ``a`` to node ``b``'s ``eth0``
        address, outside MPI: ``rtt_ms`` (median of ``count`` after 3 warm-up rounds,
        which also resolve ARP), ``min_ms``, ``max_ms``, ``lost`` (no answer in 2 s)."""
        addr = f"{SUBNET}.{b + 1}"
        out, _ = self._serve_and_run(
            b, self._in_node(b, "--udp-echo", addr, "--count", str(count + 3)),
            self._in_node(a, "--udp-ping", addr, "--count", str(count)), timeout)
        return json.loads(out)

    def measure_tcp(self, a: int = 0, b: int = 1, seconds: float = 4.0,
                    timeout: float = 60) -> dict[str, float]:
        """One TCP stream from node ``a`` to node ``b`` for ``seconds`` (Linux's own
        congestion control and buffer autotuning, outside MPI): ``mbit`` over the second
        half (steady state), ``mbit_total`` over the whole stream."""
        addr = f"{SUBNET}.{b + 1}"
        _, out = self._serve_and_run(
            b, self._in_node(b, "--tcp-sink", addr),
            self._in_node(a, "--tcp-source", addr, "--seconds", str(seconds)), timeout)
        return json.loads(out)


def _cpu_set(spec: str) -> set[int]:
    """``"0-2,5"`` -> ``{0, 1, 2, 5}`` (``taskset -c`` syntax)."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _cpu_specs(cpus, nodes: int) -> list[str] | None:
    """Normalise ``cpus`` (one entry per node: an int, an iterable of ints or a
    ``taskset -c`` list) to ``taskset -c`` strings, checked against this process's
    affinity."""
    if cpus is None:
        return None
    cpus = list(cpus)
    if len(cpus) != nodes:
        raise ValueError(f"two_tier: expected one CPU list per node ({nodes}), got "
                         f"{len(cpus)}: {cpus!r}")
    allowed = os.sched_getaffinity(0)
    specs = []
    for i, c in enumerate(cpus):
        if isinstance(c, int):
            spec = str(c)
        elif isinstance(c, str):
            spec = c.replace(" ", "")
        else:
            spec = ",".join(str(int(x)) for x in c)
        try:
            wanted = _cpu_set(spec)
        except ValueError:
            wanted = set()
        if not wanted or not wanted <= allowed:
            raise ValueError(f"two_tier: node {i}'s CPUs must be a non-empty subset of this "
                             f"process's affinity {sorted(allowed)}, got {c!r}")
        specs.append(spec)
    return specs


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
