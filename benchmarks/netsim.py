"""Run a command with every rank's traffic through a rate-limited link.

A Linux network namespace is created and its loopback shaped with an HTB class of the
given rate (``tc``); MPICH is forced onto TCP over that loopback:
``MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp MPIR_CVAR_CH4_SHM_ENABLE=0 MPIR_CVAR_NOLOCAL=1``
(all four are needed: without the netmod setting large messages bypass the limit). gloo,
which uses TCP on loopback anyway, is limited too. The limit applies to the whole
namespace: all ranks share ONE link of that rate, like ranks behind one switch port.
Needs root (``ip netns``); without it the command runs unlimited and says so.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from typing import Iterator

MPICH_TCP = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp",
             "MPIR_CVAR_CH4_SHM_ENABLE": "0", "MPIR_CVAR_NOLOCAL": "1"}


def can_shape() -> tuple[bool, str]:
    """Whether namespaces and tc are usable here, and why not."""
    if os.geteuid() != 0:
        return False, "not root: network namespaces need CAP_SYS_ADMIN"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            return False, f"'{tool}' (iproute2) is not installed"
    return True, "root with ip and tc"


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


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
