"""The exit-path registry (commlib.mpi.shutdown) on its own: weak references, newest first, a
common deadline, stuck objects reported, the final steps last; the release of MPICH's
shared-memory segments (commlib.mpi.shm) on its own (the multi-rank exit paths are in
test_faults.py, test_async_faults.py and the fault matrix)."""
import gc
import time

import pytest

from commlib.mpi import shutdown
from helpers import clean_env


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


def test_final_steps_run_after_every_object_stopped(tmp_path):
    """commlib.core.exits' agreement with the other ranks is a final step: it must come after
    commlib's threads stopped (they may still communicate), at interpreter exit."""
    import subprocess
    import sys
    script = tmp_path / "final.py"
    script.write_text(
        "from commlib import shutdown\n"
        "class Thing:\n"
        "    def stop_at_exit(self, deadline):\n"
        "        print('stopped', flush=True)\n"
        "        return True\n"
        "thing = Thing()\n"
        "shutdown.at_final(lambda: print('final', flush=True))\n"
        "shutdown.register(thing)\n"
        "print('end', flush=True)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=clean_env())
    assert out.returncode == 0 and out.stdout.split() == ["end", "stopped", "final"], out


def test_release_unlinks_only_the_segments_this_process_maps(tmp_path):
    """commlib.mpi.shm.release: a segment this process maps loses its name; a segment of the
    same kind that it does not map (another job's), or whose name now points at another
    file, is left alone; the mapping stays usable."""
    import mmap
    import os

    from commlib.mpi import shm
    if not os.path.isdir("/dev/shm") or not os.path.exists("/proc/self/maps"):
        pytest.skip("needs Linux /dev/shm")
    if not shm.prefixes():
        pytest.skip("this MPI implementation removes its /dev/shm files itself")
    shm.release()  # a singleton's own segment (import commlib already released it)
    tag = f"{os.getpid():x}"
    kind = shm.prefixes()[0]  # e.g. /dev/shm/mpich_shm_ (MPICH), /dev/shm/sm_segment. (Open MPI)
    mine, other, renamed = (f"{kind}{tag}{k}_0" for k in ("a", "b", "c"))
    maps = []
    try:
        for path in (mine, other, renamed):
            with open(path, "wb") as f:
                f.write(b"x" * 4096)
        for path in (mine, renamed):
            with open(path, "r+b") as f:
                maps.append(mmap.mmap(f.fileno(), 4096))
        os.unlink(renamed)                      # the name now points at another file
        with open(renamed, "wb") as f:
            f.write(b"y")
        paths = {p for p, _, _ in shm.mapped()}
        assert mine in paths and renamed in paths and other not in paths
        assert shm.release() == [mine]
        assert not os.path.exists(mine) and os.path.exists(other) and os.path.exists(renamed)
        maps[0][0:1] = b"z"                     # still mapped, still shared memory
        assert maps[0][0:1] == b"z"
        assert shm.release() == []              # nothing named is left to release
    finally:
        for m in maps:
            m.close()
        for path in (mine, other, renamed):
            if os.path.exists(path):
                os.unlink(path)
