"""The exit-path registry (commlib.shutdown) on its own: weak references, newest first, a
common deadline, stuck objects reported (the multi-rank exit paths are in
test_async_faults.py and the fault matrix)."""
import gc
import time

from commlib import shutdown


class Thing:
    def __init__(self, log, name, stops=True, seconds=0.0):
        self.log, self.name, self.stops, self.seconds = log, name, stops, seconds

    def stop_at_exit(self, deadline):
        self.log.append((self.name, round(deadline - time.monotonic(), 1)))
        time.sleep(self.seconds)
        return self.stops


def test_newest_first_and_stuck_reported():
    log = []
    things = [Thing(log, "a"), Thing(log, "b", stops=False), Thing(log, "c", seconds=0.2)]
    for t in things:
        shutdown.register(t)
    shutdown.register(things[0])  # twice: once
    try:
        stuck = shutdown.stop_all(grace_s=5.0)
        assert [name for name, _ in log] == ["c", "b", "a"]
        assert stuck == [things[1]]
    finally:
        for t in things:
            shutdown.unregister(t)


def test_every_object_gets_a_moment_after_the_deadline():
    log = []
    slow, late = Thing(log, "slow", seconds=0.3), Thing(log, "late")
    shutdown.register(late)
    shutdown.register(slow)
    try:
        shutdown.stop_all(grace_s=0.1)
        assert log[1][0] == "late" and log[1][1] >= shutdown.MIN_STOP_S - 0.1
    finally:
        shutdown.unregister(slow)
        shutdown.unregister(late)


def test_registration_keeps_nothing_alive():
    log = []
    t = Thing(log, "gone")
    shutdown.register(t)
    del t
    gc.collect()
    assert all(o.name != "gone" for o in shutdown.live() if isinstance(o, Thing))
    shutdown.stop_all(grace_s=0.1)
    assert log == []
