"""The probes of :mod:`netsim`'s :class:`~netsim.Cluster` measurements, each run as a
process of its own: the MPI point-to-point probe (``--probe OUT``, under the cluster's
``mpiexec``, one rank on each of two nodes: :meth:`Cluster.measure_bandwidth`) and the
socket probes outside MPI (``--udp-echo``/``--udp-ping``, ``--tcp-sink``/``--tcp-source``,
started with ``ip netns exec`` in a node: :meth:`Cluster.measure_rtt`,
:meth:`Cluster.measure_tcp`). Each prints or writes JSON."""
from __future__ import annotations

import argparse
import json
import sys

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


# -- socket probes (no MPI): run with ``ip netns exec`` in a node by Cluster.measure_* ----

PROBE_PORT = 5201


def _udp_echo(addr: str, count: int) -> None:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((addr, PROBE_PORT))
        s.settimeout(30)
        print("ready", flush=True)
        for _ in range(count):
            data, peer = s.recvfrom(64)
            s.sendto(data, peer)


def _udp_ping(addr: str, count: int) -> None:
    import socket
    import statistics
    import struct
    import time
    rtts, lost = [], 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, PROBE_PORT))
        s.settimeout(2.0)
        for i in range(count + 3):
            payload = struct.pack("!Q8x", i)
            t = time.perf_counter()
            s.send(payload)
            try:
                while s.recv(64) != payload:  # a late answer to an earlier ping
                    pass
            except TimeoutError:
                lost += 1
                continue
            if i >= 3:
                rtts.append((time.perf_counter() - t) * 1e3)
    if not rtts:
        raise SystemExit(f"netsim: no UDP answer from {addr}:{PROBE_PORT} in {count} pings")
    print(json.dumps({"rtt_ms": statistics.median(rtts), "min_ms": min(rtts),
                      "max_ms": max(rtts), "lost": lost, "count": len(rtts)}))


def _tcp_sink(addr: str) -> None:
    import socket
    import time
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, PROBE_PORT))
        s.listen(1)
        s.settimeout(30)
        print("ready", flush=True)
        conn, _ = s.accept()
        marks, total, buf = [], 0, bytearray(1 << 20)
        with conn:
            while n := conn.recv_into(buf):
                total += n
                marks.append((time.perf_counter(), total))
    (t0, _), (t1, n1) = marks[0], marks[-1]
    half = next((t, n) for t, n in marks if t >= (t0 + t1) / 2)
    print(json.dumps({"mbit": (n1 - half[1]) * 8 / max(t1 - half[0], 1e-9) / 1e6,
                      "mbit_total": n1 * 8 / max(t1 - t0, 1e-9) / 1e6, "bytes": n1}))


def _tcp_source(addr: str, seconds: float) -> None:
    import socket
    import time
    chunk = bytes(1 << 20)
    with socket.create_connection((addr, PROBE_PORT), timeout=30) as s:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            s.sendall(chunk)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--probe", help="MPI probe: write its JSON here")
    p.add_argument("--nbytes", type=int, default=16 << 20)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--udp-echo", help="serve UDP echoes on this address")
    p.add_argument("--udp-ping", help="ping this address's UDP echo")
    p.add_argument("--tcp-sink", help="receive one TCP stream on this address")
    p.add_argument("--tcp-source", help="send one TCP stream to this address")
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--seconds", type=float, default=4.0)
    args = p.parse_args(argv)
    if args.probe:
        _probe(args.probe, args.nbytes, args.reps)
        return 0
    for mode, run in (("udp_echo", lambda a: _udp_echo(a, args.count)),
                      ("udp_ping", lambda a: _udp_ping(a, args.count)),
                      ("tcp_sink", _tcp_sink),
                      ("tcp_source", lambda a: _tcp_source(a, args.seconds))):
        if getattr(args, mode):
            run(getattr(args, mode))
            return 0
    p.error("one of --probe, --udp-echo, --udp-ping, --tcp-sink, --tcp-source")
    return 2


if __name__ == "__main__":
    sys.exit(main())
