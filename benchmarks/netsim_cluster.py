"""The two-tier cluster: namespaces, veths, the hub (a bridge, or a router in front of the
delay line), the launcher wrapper that makes each node a host, and the ``mpiexec`` command
line that runs a job on it. :func:`netsim.two_tier` builds one for a ``with`` block.

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
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence

from netsim_delay import DelayLine
from netsim_link import (
    CLUSTER_ENV,
    DELAY_TABLE,
    HUB_ADDR,
    NS_PREFIX,
    SUBNET,
    _sh,
    can_build_cluster,
    can_delay_line,
    has_netem,
)
from netsim_measure import Probes
from netsim_shaping import Shaping

_WRAPPER = """#!/bin/sh
# hydra's ssh launcher calls: wrapper [-x] HOST "COMMAND ARGS..."
[ "$1" = "-x" ] && shift
host="$1"; shift
pin=""
case "$host" in
{pins}esac
exec $pin ip netns exec "{tag}-$host" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
"""



class Cluster(Shaping, DelayLine, Probes):

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
