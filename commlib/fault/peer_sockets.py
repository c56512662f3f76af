"""Watching processes on other machines by a TCP connection each (fault-tolerant mode).

A process spawned into the world (:func:`commlib.primitives.ft.grow`) lives in another
``MPI_COMM_WORLD`` than its parents, so the launcher's list of dead processes (one job's)
does not name it to them, nor them to it; on the same machine :class:`~commlib.fault.
failure_detection.LocalProcesses` watches it by process id, and on another machine this
module does, as torch's gloo and TCPStore clients notice a dead peer:

* every process of a grown world listens on a TCP port of its own (:func:`listener`, one
  per process, opened on first use; an accept thread keeps each connection it accepts
  open and never reads it);
* each process connects to every peer it must watch (:class:`RemotePeers`); when the
  peer's process dies its kernel closes the connection and the next poll reads the end
  of the stream (milliseconds); when its machine dies or drops off the network, TCP
  keepalive probes (:data:`KEEPALIVE`) go unanswered and the connection fails after about
  :data:`KEEPALIVE` ``idle + interval x count`` seconds.

A peer whose port refuses the connection is dead (it reported the port in the grow, alive,
moments before). A peer that cannot be reached in time is not watched (a warning names
it): its death is seen by ``COMMLIB_TIMEOUT`` only.
"""
from __future__ import annotations

import errno
import socket
import sys
import threading
from typing import Any

#: TCP keepalive of a watch connection: seconds idle before the first probe, seconds
#: between probes, unanswered probes before the connection fails.
KEEPALIVE = (2, 1, 3)
#: Seconds one connection attempt to a peer's port may take.
CONNECT_S = 3.0


class Listener:
    """This process's watch port: a TCP server socket on every interface and a daemon
    thread that accepts connections and holds them open (their only use: to be closed
    by this process's death)."""

    def __init__(self) -> None:
        self.server = socket.create_server(("", 0), backlog=128)
        self.port = self.server.getsockname()[1]
        self.held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="commlib-ft-watch-port",
                                        daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.held.append(conn)

    def address(self) -> tuple[str, tuple[str, ...], int]:
        """(host name, this host's non-loopback IPv4 addresses, the port)."""
        from ..mpi.mpi_env import host_addresses
        return socket.gethostname(), tuple(host_addresses()), self.port


_listener: Listener | None = None
_listener_lock = threading.Lock()


def listener() -> Listener:
    """The process's :class:`Listener`, opened on first use."""
    global _listener
    with _listener_lock:
        if _listener is None:
            _listener = Listener()
        return _listener


def _connect(host: str, addresses: tuple[str, ...], port: int,
             timeout: float) -> tuple[socket.socket | None, bool]:
    """A connection to ``port`` on the first of ``addresses`` (then ``host``) that
    answers, and whether some address refused it (the process is gone)."""
    refused = False
    for address in (*addresses, host):
        try:
            s = socket.create_connection((address, port), timeout=timeout)
        except ConnectionRefusedError:
            refused = True
            continue
        except OSError:
            continue
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        idle, interval, count = KEEPALIVE
        for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval),
                            ("TCP_KEEPCNT", count)):
            if hasattr(socket, name):
                s.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        s.setblocking(False)
        return s, refused
    return None, refused


class RemotePeers:
    """Detector of the dead among ``peers`` (rank -> :meth:`Listener.address` of that
    rank's process, reported alive): a connection to each, made now; a rank is dead from
    the first poll that reads the end of its connection or an error on it (or whose port
    refused the connection). ``me``: this process's rank, for the warnings."""

    def __init__(self, peers: dict[int, Any], me: int, timeout: float = CONNECT_S) -> None:
        self.socks: dict[int, socket.socket] = {}
        self.dead: set[int] = set()
        for rank, (host, addresses, port) in sorted(peers.items()):
            s, refused = _connect(host, tuple(addresses), int(port), timeout)
            if s is not None:
                self.socks[rank] = s
            elif refused:
                self.dead.add(rank)
            else:
                print(f"commlib (rank {me}): rank {rank}'s watch port {host}:{port} "
                      f"({', '.join(addresses)}) cannot be reached: its death will be "
                      f"seen by COMMLIB_TIMEOUT only", file=sys.stderr, flush=True)

    @property
    def watched(self) -> set[int]:
        return set(self.socks) | self.dead

    def __call__(self) -> set[int]:
        for rank, s in list(self.socks.items()):
            try:
                data = s.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EINTR):
                    continue
                data = b""
            if not data:  # the end of the stream (or an error): the process is gone
                self.dead.add(rank)
                del self.socks[rank]
                s.close()
        return self.dead

    def close(self) -> None:
        for s in self.socks.values():
            s.close()
        self.socks.clear()
