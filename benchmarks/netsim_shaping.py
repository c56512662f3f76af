"""The shaping of a two-tier cluster's links: an HTB class of the node's rate on both ends
of every node's veth (and netem under it where the kernel has it), and the node namespaces'
TCP buffers when there is a delay. A mixin of :class:`netsim_cluster.Cluster`.

With any delay (netem or delay line) the node namespaces' ``net.ipv4.tcp_rmem``/
``tcp_wmem`` maxima are raised to 4 bandwidth-delay products when that is above the
defaults (per-namespace sysctls; see :meth:`Cluster._tcp_buffers`).
"""
from __future__ import annotations

from collections.abc import Sequence

import netsim_link
from netsim_link import _sh, _sysctl


class Shaping:
    """HTB (and netem) on one device; the TCP buffer maxima of one node namespace.
    Needs ``rate_mbit``, ``delay_ms`` and ``loss_pct`` (:class:`netsim_cluster.Cluster`)."""

    rate_mbit: float | None
    delay_ms: float
    loss_pct: float

    def _tcp_buffers(self, innode: Sequence[str]) -> None:
        """With delay, let TCP's autotuning grow to a few bandwidth-delay products: the
        round trip is 2 x ``delay_ms`` and the default ``tcp_wmem`` maximum (4 MiB) is
        below one BDP from ~650 Mbit/s at 50 ms. Per-namespace sysctls: only the nodes."""
        if not netsim_link.TUNE_TCP_BUFFERS:
            return
        rate = self.rate_mbit or 10000
        bdp = int(rate * 1e6 / 8 * 2 * self.delay_ms / 1e3)
        top = max(4 << 20, 4 * bdp)
        for key in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
            low, default, high = _sysctl(innode, key).split()
            if int(high) < top:
                _sh(*innode, "sysctl", "-qw", f"{key}={low} {default} {top}")

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
