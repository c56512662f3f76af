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

Delay and loss need the ``netem`` qdisc; a kernel built without it
(``CONFIG_NET_SCH_NETEM`` unset, as on our benchmark VM) gets rate shaping only and
:attr:`Cluster.why` says that ``delay_ms``/``loss_pct`` were not applied.

Names are unique per cluster (``cl<hex>-hub``, ``cl<hex>-node<i>``; nothing is created in
the root namespace), and everything is deleted on every exit path of the ``with`` block
(exception, Ctrl-C, SIGTERM). Without root, ``ip``, ``tc`` or bridge support the cluster
says why and runs unshaped on one host, nodes simulated with
``COMMLIB_LOCAL_SIZE=ranks_per_node`` (still a valid MPI job).

``python benchmarks/netsim.py --nodes 2 --ranks-per-node 2 --rate 1000`` builds a cluster,
prints its measured bandwidth and topology, and tears it down.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from typing import Iterator, Sequence

MPICH_TCP = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp",
             "MPIR_CVAR_CH4_SHM_ENABLE": "0", "MPIR_CVAR_NOLOCAL": "1"}
# Inter-node traffic over TCP on eth0; shared memory inside a node stays on.
CLUSTER_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0",
               "FI_SOCKETS_IFACE": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}
SUBNET = "10.13.0"
HUB_ADDR = f"{SUBNET}.254"
NS_PREFIX = "cl"


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


def leftovers() -> list[str]:
    """Namespaces of clusters (this module's names) that exist now."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(NS_PREFIX) and ("-hub" in n or "-node" in n
                                                            or "-probe" in n)]


_WRAPPER = """#!/bin/sh
# hydra's ssh launcher calls: wrapper [-x] HOST "COMMAND ARGS..."
[ "$1" = "-x" ] && shift
host="$1"; shift
exec ip netns exec "{tag}-$host" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
"""


class Cluster:
    """A running two-tier cluster (see the module docstring); made by :func:`two_tier`.

    ``shaped``: whether nodes are real namespaces (else one host, ``COMMLIB_LOCAL_SIZE``
    simulation); ``why``: what was built and what was not applied."""

    def __init__(self, nodes: int, ranks_per_node: int, rate_mbit: float | None,
                 delay_ms: float, loss_pct: float) -> None:
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        self.rate_mbit, self.delay_ms, self.loss_pct = rate_mbit, delay_ms, loss_pct
        self.tag = f"{NS_PREFIX}{uuid.uuid4().hex[:6]}"
        self.shaped, self.why = False, ""
        self.delay_applied = False
        self.hosts = [f"node{i}" for i in range(nodes)]
        self._dir: str | None = None
        self._namespaces: list[str] = []
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
            print(f"netsim: {self.why}", flush=True)
            self.env = dict(base, COMMLIB_LOCAL_SIZE=str(self.ranks_per_node))
            return
        netem = has_netem() if (self.delay_ms or self.loss_pct) else False
        self._dir = tempfile.mkdtemp(prefix=f"{self.tag}-")
        wrapper = os.path.join(self._dir, "nsexec")
        with open(wrapper, "w") as fh:
            fh.write(_WRAPPER.format(tag=self.tag))
        os.chmod(wrapper, 0o755)
        self._wrapper = wrapper
        hub = self.hub
        _sh("ip", "netns", "add", hub)
        self._namespaces.append(hub)
        inhub = ("ip", "netns", "exec", hub)
        _sh(*inhub, "ip", "link", "set", "lo", "up")
        _sh(*inhub, "ip", "link", "add", "br0", "type", "bridge")
        _sh(*inhub, "ip", "addr", "add", f"{HUB_ADDR}/24", "dev", "br0")
        _sh(*inhub, "ip", "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns = self.namespace(i)
            _sh("ip", "netns", "add", ns)
            self._namespaces.append(ns)
            port = f"port{i}"
            _sh("ip", "link", "add", "name", port, "netns", hub, "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _sh(*inhub, "ip", "link", "set", port, "master", "br0")
            _sh(*inhub, "ip", "link", "set", port, "up")
            innode = ("ip", "netns", "exec", ns)
            _sh(*innode, "ip", "link", "set", "lo", "up")
            _sh(*innode, "ip", "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            _sh(*innode, "ip", "link", "set", "eth0", "up")
            # upload: the node's eth0; download: the bridge port towards the node
            self._shape(innode, "eth0", netem)
            self._shape(inhub, port, False)
        self.delay_applied = netem
        parts = [f"{self.nodes} namespaces x {self.ranks_per_node} ranks on a bridge"]
        parts.append(f"HTB {self.rate_mbit:g} Mbit/s each way per node" if self.rate_mbit
                     else "no rate limit")
        if self.delay_ms or self.loss_pct:
            parts.append(f"netem delay {self.delay_ms} ms loss {self.loss_pct}%" if netem else
                         f"delay {self.delay_ms} ms / loss {self.loss_pct}% NOT applied: the "
                         f"kernel has no netem qdisc (CONFIG_NET_SCH_NETEM)")
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

    def _teardown(self) -> None:
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
            argv = [sys.executable, os.path.abspath(__file__), "--probe", out,
                    "--nbytes", str(nbytes), "--reps", str(reps)]
            code = self.mpiexec(argv, timeout=timeout, hosts=hosts)
            if code:
                raise RuntimeError(f"netsim: bandwidth probe exited {code}")
            with open(out) as fh:
                return json.load(fh)
        finally:
            os.unlink(out)


@contextlib.contextmanager
def two_tier(nodes: int = 2, ranks_per_node: int = 2, rate_mbit: float | None = 1000,
             delay_ms: float = 0.0, loss_pct: float = 0.0) -> Iterator[Cluster]:
    """Build a two-tier cluster (see the module docstring) for the ``with`` block; it is
    torn down on every exit. ``rate_mbit``: each node's link rate in each direction
    (``None``: unlimited); ``delay_ms``: one-way delay added on each node's upload
    (round trip between two nodes: 2x); ``loss_pct``: packet loss on each node's upload."""
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"two_tier: nodes and ranks_per_node must be >= 1, got {nodes}, "
                         f"{ranks_per_node}")
    cluster = Cluster(nodes, ranks_per_node, rate_mbit, delay_ms, loss_pct)
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


# -- the probe: runs under mpiexec, one rank on each of two nodes --------------------------

def _probe(out: str, nbytes: int, reps: int) -> None:
    import socket
    import statistics
    import time

    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    data = np.ones(nbytes, dtype=np.uint8)
    ack = np.zeros(1, dtype=np.uint8)

    def there_and_back(buf: np.ndarray) -> None:
        """Rank 0 sends ``buf``, rank 1 answers with one byte."""
        if rank == 0:
            comm.Send(buf, dest=1)
            comm.Recv(ack, source=1)
        else:
            comm.Recv(buf, source=0)
            comm.Send(ack, dest=0)

    for _ in range(2):  # warm-up: connection setup, TCP window growth
        there_and_back(data[: 1 << 20])
    rates = []
    for _ in range(reps):
        comm.Barrier()
        t = time.perf_counter()
        there_and_back(data)
        rates.append(nbytes * 8 / (time.perf_counter() - t) / 1e6)
    rtts = []
    for _ in range(50):
        t = time.perf_counter()
        there_and_back(ack)
        rtts.append((time.perf_counter() - t) * 1e3)
    hosts = comm.gather(socket.gethostname(), root=0)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"mbit": max(rates), "mbit_all": rates,
                       "rtt_ms": statistics.median(rtts), "hosts": hosts}, fh)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build a two-tier cluster, measure it, tear it down.")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--rate", type=float, default=1000, help="Mbit/s per node link; 0: none")
    p.add_argument("--delay", type=float, default=0.0, help="one-way ms")
    p.add_argument("--loss", type=float, default=0.0, help="percent")
    p.add_argument("--probe", help=argparse.SUPPRESS)
    p.add_argument("--nbytes", type=int, default=16 << 20)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    if args.probe:
        _probe(args.probe, args.nbytes, args.reps)
        return 0
    with two_tier(args.nodes, args.ranks_per_node, args.rate or None, args.delay,
                  args.loss) as cluster:
        print(f"netsim: {cluster.why}")
        if args.nodes > 1:
            print("between nodes 0 and 1:", cluster.measure_bandwidth(0, 1,
                                                                    nbytes=args.nbytes))
        if args.ranks_per_node > 1:
            print("inside node 0:", cluster.measure_bandwidth(0, 0, nbytes=args.nbytes))
        cluster.mpiexec([sys.executable, "-m", "commlib.info"], timeout=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
