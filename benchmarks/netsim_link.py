"""Network emulation, the basics: constants, the capability checks, one shared shaped link.

**One shared link** (:func:`shaped_namespace`, :func:`run_limited`): a Linux network
namespace whose loopback is shaped with an HTB class of the given rate (``tc``); MPICH is
forced onto TCP over that loopback:
``MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp MPIR_CVAR_CH4_SHM_ENABLE=0 MPIR_CVAR_NOLOCAL=1``
(all four are needed: without the netmod setting large messages bypass the limit). gloo,
which uses TCP on loopback anyway, is limited too. The limit applies to the whole
namespace: all ranks share ONE link of that rate, like ranks behind one switch port.

The capability checks (:func:`can_shape`, :func:`can_build_cluster`, :func:`has_netem`,
:func:`can_delay_line`) say whether this machine can build what :mod:`netsim_cluster` builds,
and why not; :func:`leftovers` lists namespaces of clusters that still exist. Part of
:mod:`netsim` (which re-exports every public name here).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
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
# (Cluster._tcp_buffers); False only to measure what Linux's defaults do (set it here,
# netsim_link.TUNE_TCP_BUFFERS: netsim's re-exported copy is not read).
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
