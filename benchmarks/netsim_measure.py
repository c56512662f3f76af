"""The measurements of a two-tier cluster: MPI point-to-point bandwidth and round trip
(:meth:`Probes.measure_bandwidth`), a UDP ping-pong (:meth:`Probes.measure_rtt`) and one TCP
stream (:meth:`Probes.measure_tcp`) between nodes, each run by :mod:`netsim_probes` inside
the cluster. A mixin of :class:`netsim_cluster.Cluster`.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile

from netsim_link import PROBES, SUBNET


class Probes:
    """Needs ``mpiexec``, ``shaped``, ``namespace`` and ``why``
    (:class:`netsim_cluster.Cluster`)."""

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
