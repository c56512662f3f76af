"""The standby store of the store-backed world (:mod:`commlib.mpi.launch.standby`), without
MPI: real torch ``TCPStore`` servers, the primary's in a child process that is SIGKILLed as a
dying rank 0 would be. Two clients in this process stand for ranks 1 (the standby's host)
and 2. Checked: writes reach both stores, reads the primary; a rank's earlier writes are
replayed into a standby it joins late; the primary's death switches every rank to the
standby, which holds what was written, and names the old host dead; the next standby is
hosted by the lowest rank alive; a lost standby is passed over. Negative control: without a
standby the same death raises the store's error."""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("torch.distributed")
from torch.distributed import TCPStore  # noqa: E402

from commlib.mpi.launch import standby  # noqa: E402

NS = "commlib/mpi/launch/test/0"
TIMEOUT = datetime.timedelta(seconds=10)
SERVER = """
import datetime, sys, time
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
             timeout=datetime.timedelta(seconds=10))
print(s.port, flush=True)
time.sleep(120)
"""


@pytest.fixture
def primary():
    """(a client of a store hosted by a child process, the process)."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        yield TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                       timeout=TIMEOUT), port, proc
    finally:
        proc.kill()
        proc.wait()


def rank(r: int, port: int, dead: set, failed: list) -> standby.ReplicatedStore:
    client = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                      timeout=TIMEOUT)

    def on_failover(old: int) -> None:
        dead.add(old)
        failed.append((r, old))
    store = standby.ReplicatedStore(client, 0, r, 4, NS, ("127.0.0.1", port), 10.0,
                                    dead=lambda: dead, on_failover=on_failover)
    store.shared_keys = lambda: ["abort"]
    return store


def kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_the_standby_takes_over(primary):
    _, port, proc = primary
    dead: set[int] = set()
    failed: list = []
    one, two = rank(1, port, dead, failed), rank(2, port, dead, failed)
    two.set(f"{NS}/ft/pid/2", "host 22")          # before any standby: replayed later
    two.add(f"{NS}/ft/beat/2", 1)
    two.add(f"{NS}/ft/beat/2", 1)
    two.refresh()                                 # not rank 2's to host: nothing yet
    assert two.standby is None
    one.refresh()                                 # rank 1, the lowest rank alive but 0
    assert one.standby_host == 1 and one.hosts_a_store()
    two.refresh()                                 # rank 2 joins it, replaying its writes
    assert two.standby_host == 1 and not two.hosts_a_store()
    server = one.servers[0]
    assert server.get(f"{NS}/ft/pid/2") == b"host 22"
    assert server.add(f"{NS}/ft/beat/2", 0) == 2
    two.set(f"{NS}/left/2", "1")                  # after: written to both
    assert server.get(f"{NS}/left/2") == b"1"
    assert two.add(f"{NS}/ft/beat/1", 0) == 0     # a read: no key made in the standby
    assert not server.check([f"{NS}/ft/beat/1"])
    assert not two.urgent() and not one.urgent()

    kill(proc)                                    # rank 0, the store's host, dies
    assert two.get(f"{NS}/ft/pid/2") == b"host 22"   # from rank 1's store now
    assert two.host == 1 and failed == [(2, 0)] and dead == {0}
    assert two.add(f"{NS}/ft/beat/2", 1) == 3
    assert one.urgent()                           # 0 is known dead: poll at once
    assert one.check([f"{NS}/left/2"])            # rank 1 switches to its own store
    assert one.host == 1 and one.standby is None and failed[-1] == (1, 0)
    # the next standby: rank 2, the lowest rank alive but the host (1)
    one.refresh()
    assert one.standby is None                    # not rank 1's to host
    two.refresh()
    assert two.standby_host == 2 and two.slot == 1
    one.refresh()
    assert one.standby_host == 2
    assert two.servers[0].get(f"{NS}/ft/pid/2") == b"host 22"   # replayed again


def test_a_lost_standby_is_passed_over(primary):
    client, port, _ = primary
    other = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE,
                             text=True)                # rank 1's standby, in a process
    try:
        client.set(f"{NS}/standby/0", f"1 127.0.0.1 {int(other.stdout.readline())}")
        dead: set[int] = set()
        failed: list = []
        two, three = rank(2, port, dead, failed), rank(3, port, dead, failed)
        two.refresh()
        three.refresh()
        assert two.standby_host == 1 == three.standby_host
        kill(other)                                   # rank 1 dies
        two.set(f"{NS}/x", "1")                       # (a set is not answered: sent)
        two.refresh()                                 # the poll's probe fails: dropped
        assert two.standby is None and two.slot == 1 and failed == []
        assert two.urgent()                           # and a new one wanted at once
        dead.add(1)                                   # rank 1 dead: rank 2 hosts the next
        two.refresh()
        assert two.standby_host == 2
        three.refresh()                               # rank 3's poll: rank 1's is gone,
        assert three.standby_host == 2 and three.slot == 1   # rank 2's is there
        assert two.servers[0].get(f"{NS}/x") == b"1"  # replayed
        assert client.get(f"{NS}/x") == b"1"          # the primary carries on
    finally:
        other.kill()
        other.wait()


def test_without_a_standby_the_hosts_death_is_the_stores_error(primary):
    """Negative control: no standby (refresh never called), the same death raises."""
    _, port, proc = primary
    dead: set[int] = set()
    failed: list = []
    two = rank(2, port, dead, failed)
    two.set(f"{NS}/x", "1")
    kill(proc)
    with pytest.raises(RuntimeError) as info:
        two.get(f"{NS}/x")
    assert standby.lost(info.value) and failed == [] and dead == set()


def test_wanted_only_in_fault_tolerant_mode():
    assert standby.wanted({"COMMLIB_FAULT_TOLERANT": "1"})
    assert not standby.wanted({"COMMLIB_FAULT_TOLERANT": "1", "COMMLIB_STORE_STANDBY": "0"})
    assert not standby.wanted({})
    assert not standby.wanted({"COMMLIB_FAULT_TOLERANT": "0", "COMMLIB_STORE_STANDBY": "1"})
