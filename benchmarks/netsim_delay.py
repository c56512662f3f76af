"""The hookup of the userspace TUN delay line (:mod:`delayline`) in a two-tier cluster's
hub: start the forwarder, route every node-to-node packet through its device, report its
CPU time and traffic, stop it. A mixin of :class:`netsim_cluster.Cluster`.

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
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import warnings
from collections.abc import Sequence

from netsim_link import (
    DELAY_DEV,
    DELAY_TABLE,
    DELAYLINE,
    DELAYLINE_LOSS_MAX_MBIT,
    DELAYLINE_MAX_MBIT,
    SUBNET,
    _sh,
)


class DelayLine:
    """The forwarder of one cluster (``_forwarder``: its process, ``None`` when there is
    none). Needs ``_dir``, ``hub``, ``nodes``, ``rate_mbit``, ``delay_ms``, ``loss_pct`` and
    ``why`` (:class:`netsim_cluster.Cluster`)."""

    _forwarder: subprocess.Popen | None = None
    _forwarder_priority = ""

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
