"""commlib.fault.peer_sockets: processes of a grown world on other machines are watched by a
TCP connection to each one's watch port: a killed process is seen dead at the next poll
(its kernel closes the connection), a refused port is dead at once, an unreachable one is
not watched and named; ``Watcher.watch_grown`` watches by connection exactly the peers of
another ``MPI_COMM_WORLD`` on another machine (those of this machine by process id, those
of this process's own world are left to the launcher). One process and its children; the
multi-rank case is tests/test_elastic_spares.py's ``replacement-remote``."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

from commlib.fault import failure_detection as fd
from commlib.fault import peer_sockets

LISTEN = ("import json, sys, time\n"
          "from commlib.fault.peer_sockets import listener\n"
          "print(json.dumps(listener().address()), flush=True)\n"
          "time.sleep(120)\n")


def listening_child() -> tuple[subprocess.Popen, tuple]:
    proc = subprocess.Popen([sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
    host, addresses, port = json.loads(proc.stdout.readline())
    return proc, (host, tuple(addresses), port)


def poll_until(detector, rank: int, seconds: float) -> float:
    """Seconds until ``detector`` names ``rank`` dead (polled as the watcher does)."""
    start = time.monotonic()
    while rank not in detector():
        assert time.monotonic() - start < seconds, f"rank {rank} not seen dead in {seconds} s"
        time.sleep(fd.POLL_S)
    return time.monotonic() - start


def test_a_killed_peer_is_seen_dead_by_its_connection():
    proc, address = listening_child()
    try:
        peers = peer_sockets.RemotePeers({5: address}, me=0)
        assert peers.watched == {5} and peers() == set()
        time.sleep(0.3)
        assert peers() == set(), "a living peer counted dead"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert poll_until(peers, 5, 2.0) < 2.0
        assert peers() == {5}  # monotone
    finally:
        proc.kill()
        proc.wait()


def test_a_stopped_peer_is_alive():
    """A peer that does not run (SIGSTOP: a long step, a debugger) is not dead: its kernel
    holds the connection (and answers keepalive probes)."""
    proc, address = listening_child()
    try:
        peers = peer_sockets.RemotePeers({1: address}, me=0)
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert peers() == set()
            time.sleep(fd.POLL_S)
    finally:
        proc.kill()
        proc.wait()


def test_a_refused_port_is_dead_at_once():
    with socket.create_server(("", 0)) as s:
        port = s.getsockname()[1]
    peers = peer_sockets.RemotePeers({3: ("localhost", ("127.0.0.1",), port)}, me=0)
    assert peers() == {3} and peers.watched == {3}


def test_an_unreachable_port_is_not_watched_and_named(capsys):
    peers = peer_sockets.RemotePeers({2: ("no-such-host.invalid", (), 9)}, me=4,
                                     timeout=0.5)
    assert peers() == set() and peers.watched == set()
    err = capsys.readouterr().err
    assert "commlib (rank 4): rank 2's watch port no-such-host.invalid:9" in err
    assert "COMMLIB_TIMEOUT only" in err


def bare_watcher() -> fd.Watcher:
    w = fd.Watcher.__new__(fd.Watcher)  # (no thread, no MPI)
    w.lock = threading.Lock()
    w.changed = threading.Condition(w.lock)
    w.dead, w.waiting, w.listeners = frozenset(), {}, []
    w.launcher, w.grown, w.remote, w.epoch, w.raw_dead, w.polls = None, None, None, 0, set(), 0
    return w


def test_the_grown_world_is_watched_by_process_id_here_and_by_connection_elsewhere():
    """Grown world of 4 seen from rank 0, whose own MPI_COMM_WORLD holds ranks 0 and 1:
    rank 1 (another machine, own world) is left to the launcher, rank 2 (spawned, this
    machine) is watched by process id, rank 3 (spawned, another machine) by connection;
    rank 3's death reaches the watcher's dead set."""
    here = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    far, address = listening_child()
    try:
        boot, ns, _, _ = fd.this_process()
        procs = {0: fd.this_process(), 1: ("other-boot", ns, 11, 1),
                 2: (boot, ns, here.pid, fd._start_time(here.pid)),
                 3: ("other-boot", ns, far.pid, 1)}
        ports = {r: address for r in procs}  # (only rank 3's is used)
        w = bare_watcher()
        w.det_map = {0: 0, 1: 1}  # this process's MPI_COMM_WORLD ranks -> grown ranks
        w.watch_grown(procs, 0, ports)
        assert set(w.grown.watched) == {2} and w.remote.watched == {3}
        assert w.poll() == frozenset()
        far.send_signal(signal.SIGKILL)
        far.wait()
        start = time.monotonic()
        while 3 not in w.poll():
            assert time.monotonic() - start < 2.0, "rank 3's death not seen"
            time.sleep(fd.POLL_S)
        assert w.dead == frozenset({3})
    finally:
        for p in (here, far):
            p.kill()
            p.wait()


def test_without_ports_nothing_is_watched_by_connection():
    """Negative control of the test above: the same world without the ports (as before
    the watch by connection) leaves rank 3 unwatched, so its death goes unseen."""
    boot, ns, _, _ = fd.this_process()
    w = bare_watcher()
    w.det_map = {0: 0, 1: 1}
    w.watch_grown({0: fd.this_process(), 3: ("other-boot", ns, 12, 1)}, 0)
    assert w.remote is None and not w.grown.watched
