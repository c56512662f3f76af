"""Launching fault-tolerant jobs for the elastic tests (one hydra proxy per rank, or per
emulated node with ``benchmarks/netsim.py``), and checking what they leave behind."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

from helpers import clean_env, mpiexec

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def per_rank_hosts(n: int) -> list[str]:
    """``mpiexec`` options giving each of ``n`` ranks a hydra proxy of its own (each its own
    "node"), so that one rank can die alone, and the launcher keeps the others running."""
    hosts = ",".join(f"127.0.0.{i + 1}" for i in range(n))
    return ["-launcher", "fork", "-hosts", hosts, "-ppn", "1", "-disable-auto-cleanup"]


def run_job(n: int, argv: list[str], timeout: float, per_rank: bool = True,
            **env: str | None) -> tuple[int, float, str, list[int]]:
    """Run ``mpiexec [per-rank options] -n n python argv...`` in a session of its own with
    an outer timeout. Returns (status, seconds, output, pids of the session still alive
    afterwards); a job past ``timeout`` is killed (whole session) and reported as -9."""
    cmd = [mpiexec()] + (per_rank_hosts(n) if per_rank else []) + ["-n", str(n),
                                                                  sys.executable] + argv
    env.setdefault("PYTHONPATH", ROOT + os.pathsep + HERE)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=clean_env(**env), start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = -9
    seconds = time.monotonic() - start
    left = session_pids(proc.pid)
    for pid in left:  # never leave anything behind, even when the test fails
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return code, seconds, out, left


def session_pids(sid: int) -> list[int]:
    """Processes of session ``sid`` still alive (zombies excluded)."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                text = f.read()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(stat.split("/")[2]))
    return found


def results(outdir: str, prefix: str = "rank") -> dict[int, dict]:
    """The ``{prefix}{r}.json`` files a job's ranks wrote, by rank."""
    found = {}
    for path in glob.glob(os.path.join(outdir, f"{prefix}*.json")):
        with open(path) as f:
            data = json.load(f)
        found[int(os.path.basename(path)[len(prefix):-5])] = data
    return found


def leftover_shm(outdir: str) -> list[str]:
    """Segments the ranks announced in ``shm{r}.json`` that are still in ``/dev/shm``."""
    names = set()
    for data in results(outdir, "shm").values():
        names.update(data)
    return sorted(n for n in names if os.path.exists(os.path.join("/dev/shm", n)))


def write_shm(outdir: str, rank: int) -> None:
    """In a job: record the MPICH segments this rank maps (``shm{rank}.json``)."""
    from helpers import mpich_segments
    with open(os.path.join(outdir, f"shm{rank}.json"), "w") as f:
        json.dump(mpich_segments(), f)
