"""commlib.fault.failure_detection.LocalProcesses: the peers of this machine and pid namespace are
watched through their process ids, with no message (and so no PMI request in flight when a
rank dies); a process that is gone, a zombie or another process with the same id counts
dead; a peer of another machine or pid namespace is not watched, and then the launcher is
still asked (``covers_world``). Multi-rank behaviour: tests/test_elastic_ft.py."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from commlib.fault import failure_detection as fd


def child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def as_peer(proc: subprocess.Popen) -> tuple[str, str, int, int]:
    boot, ns, _, _ = fd.this_process()
    return boot, ns, proc.pid, fd._start_time(proc.pid)


def test_this_process_names_machine_namespace_and_start():
    boot, ns, pid, start = fd.this_process()
    assert boot and ns.startswith("pid:[") and pid == os.getpid() and start > 0
    assert fd._start_time(pid) == start


@pytest.mark.parametrize("reap", [False, True])
def test_a_killed_peer_counts_dead_zombie_or_reaped(reap):
    a, b = child(), child()
    try:
        peers = {0: fd.this_process(), 1: as_peer(a), 2: as_peer(b)}
        local = fd.LocalProcesses(peers, me=0, world_size=3)
        assert set(local.watched) == {1, 2} and local.covers_world()
        assert local() == set()
        a.send_signal(signal.SIGKILL)
        if reap:
            a.wait()
        else:  # killed, not reaped: a zombie
            deadline = time.monotonic() + 10
            while fd._start_time(a.pid) is not None and time.monotonic() < deadline:
                time.sleep(0.01)
        assert local() == {1}
        assert local() == {1}  # monotone, and the live one stays alive
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_a_reused_process_id_is_not_the_peer():
    """A peer whose id now names another process (other start time) counts dead; one that
    reports a start time its id does not have is not watched at all."""
    a = child()
    try:
        boot, ns, pid, start = as_peer(a)
        local = fd.LocalProcesses({1: (boot, ns, pid, start)}, me=0, world_size=2)
        local.watched[1] = (pid, start - 1)   # as if the peer's process had been replaced
        assert local() == {1}
        local = fd.LocalProcesses({1: (boot, ns, pid, start + 1)}, me=0, world_size=2)
        assert local.watched == {} and not local.covers_world()
    finally:
        a.kill()
        a.wait()


def test_a_peer_gone_before_the_watch_starts_is_dead_where_it_reported_alive():
    """``gone_is_dead`` (the grown world's watch, ``Watcher.watch_grown``: every peer
    reported in the grow, so it was alive): a peer whose process is gone by the time the
    watch is built counts dead at the first poll. Without it such a peer is not watched
    (then its death went unseen: a spawned replacement waited for a dead survivor until
    the watchdog)."""
    a = child()
    peer = as_peer(a)
    a.kill()
    a.wait()
    grown = fd.LocalProcesses({1: peer}, me=0, world_size=2, gone_is_dead=True)
    assert grown() == {1} and grown.covers_world()
    plain = fd.LocalProcesses({1: peer}, me=0, world_size=2)
    assert plain() == set() and not plain.covers_world()


def test_a_poll_across_a_rebase_is_dropped():
    """A poll that read the detectors before a rebase (ranks of the old world) must not put
    them into the new world's dead set (old rank 2, dead, is a living newcomer now)."""
    w = fd.Watcher.__new__(fd.Watcher)  # (no thread, no MPI: the poll alone)
    import threading
    w.lock = threading.Lock()
    w.changed = threading.Condition(w.lock)
    w.dead, w.waiting, w.listeners = frozenset(), {}, []
    w.launcher, w.det_map, w.grown, w.epoch, w.raw_dead, w.polls = None, None, None, 0, set(), 0
    w.remote = None

    def source():  # the old world's rank 2 is dead (identity map: no rebase yet)
        return [2]

    def rebase_now():  # read after the ranks were mapped: the rebase comes in between
        w.grown = None
        w.epoch += 1
        w.det_map = {0: 0, 1: 1}
        w.dead = frozenset({-1})
        return set()
    w.grown = rebase_now
    fd.SOURCES.append(source)
    try:
        assert 2 not in w.poll() and w.dead == frozenset({-1})
        assert 2 not in w.poll()  # and the next poll maps it: not a rank of the new world
    finally:
        fd.SOURCES.remove(source)


def test_peers_of_other_machines_or_namespaces_are_left_to_the_launcher():
    a = child()
    try:
        boot, ns, pid, start = as_peer(a)
        peers = {1: ("another-boot-id", ns, pid, start), 2: (boot, "pid:[1]", pid, start),
                 3: (boot, ns, pid, start)}
        local = fd.LocalProcesses(peers, me=0, world_size=4)
        assert set(local.watched) == {3} and not local.covers_world()
    finally:
        a.kill()
        a.wait()


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs unshare and root")
def test_a_process_in_another_pid_namespace_reports_another_namespace():
    code = ("from commlib import failure_detection as fd; b, ns, pid, s = fd.this_process(); "
            "print(b, ns, pid)")
    got = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                          code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert got.returncode == 0, got.stderr
    boot, ns, pid = got.stdout.split()
    mine = fd.this_process()
    assert boot == mine[0] and ns != mine[1] and pid == "1"
