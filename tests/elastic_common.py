"""Launching fault-tolerant jobs for the elastic tests, on the MPI implementation under
test (:mod:`commlib.mpi.mpi_impl`: each rank a failure domain of its own, and the launcher's
options under which a dead rank does not end the job: one hydra proxy per rank and
``-disable-auto-cleanup`` on MPICH, ``--with-ft ulfm`` on Open MPI, ``-disable-auto-cleanup``
on Intel MPI), or one hydra proxy per emulated node with ``benchmarks/netsim.py`` (MPICH),
and checking what they leave behind."""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from helpers import clean_env, mpi_impl, mpiexec

#: The variable that marks every process of a job (:func:`tag_job`).
JOB_TAG = "ELASTIC_TEST_JOB"

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def per_rank_hosts(n: int, keep_running: bool = True) -> list[str]:
    """``mpiexec`` options for ``n`` ranks under which one rank can die alone (each rank a
    failure domain of its own: on MPICH a hydra proxy each, on its own "host"
    ``127.0.0.i``) and (``keep_running``) the launcher keeps the others running
    (:meth:`commlib.mpi.mpi_impl.Implementation.launch_args`); skips the test, naming the
    implementation's reason, where fault-tolerant mode is refused."""
    try:
        return mpi_impl().launch_args(n, fault_tolerant=keep_running, rank_domains=True)[:-2]
    except ValueError as exc:
        pytest.skip(str(exc))


def fault_tolerance_refusal() -> str | None:
    """Why fault-tolerant jobs cannot run on the implementation under test (None where they
    can), for ``skipif``."""
    impl = mpi_impl()
    if impl.fault_tolerance is None or impl.keep_running_args is None:
        return f"fault-tolerant mode is not available on {impl.describe()}: " \
               f"{impl.fault_tolerance_refusal}"
    return None


@pytest.fixture
def fault_tolerant_launch() -> None:
    """Skip the test, naming the implementation's reason, where fault-tolerant jobs cannot
    run (checked when the test runs: collecting must not start MPI)."""
    why = fault_tolerance_refusal()
    if why:
        pytest.skip(why)


def rank_hosts(n: int) -> str:
    """``ELASTIC_HOSTS`` for a job of ``n`` ranks: each rank's host under
    :func:`per_rank_hosts` (where a replacement is spawned), "" where they name none."""
    return ",".join(mpi_impl().rank_domain_hosts(n) or [])


def cluster_refusal() -> str | None:
    """Why the emulated cluster (``benchmarks/netsim.py``, hydra's ``-launcher ssh``) cannot
    run this implementation's fault-tolerant jobs (None where it can: MPICH)."""
    impl = mpi_impl()
    if impl.key != "mpich":
        return f"netsim's cluster launches with MPICH's hydra and UCX, not {impl.describe()}"
    return None


#: Seconds a job's processes may take to exit after its launcher returned.
LEFT_GRACE_S = 10.0


def run_job(n: int, argv: list[str], timeout: float, per_rank: bool = True,
            keep_running: bool = True, **env: str | None) -> tuple[int, float, str, list[int]]:
    """Run ``mpiexec [per-rank options] -n n python argv...`` in a session of its own with
    an outer timeout. Returns (status, seconds, output, pids of the session still alive
    afterwards); a job past ``timeout`` is killed (whole session) and reported as -9.
    ``per_rank=False``: the plain launch (one hydra proxy for the host). ``keep_running=
    False`` (jobs without failures, e.g. references): without the keep-running options
    (MPICH's ``-disable-auto-cleanup``, under which hydra now and then ends a job whose
    ranks all exited 0 with status 255: it tells the other proxies of each exit and one had
    gone, "unable to send SIGUSR1 downstream")."""
    cmd = [mpiexec()] + (per_rank_hosts(n, keep_running) if per_rank else
                         mpi_impl().launch_args(n)[:-2]) + ["-n", str(n), sys.executable] + argv
    env.setdefault("PYTHONPATH", ROOT + os.pathsep + HERE)
    full = clean_env(**env)
    tag = tag_job(full)
    start = time.monotonic()
    # restore_signals=False: SIGPIPE stays ignored in mpiexec, which otherwise dies of it
    # now and then at the end of a job with one proxy per rank (a write to a proxy whose
    # rank had just ended).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=full, start_new_session=True, text=True,
                            restore_signals=False)
    return _finish(proc, tag, timeout, start)


def _finish(proc: subprocess.Popen, tag: str, timeout: float,
            start: float) -> tuple[int, float, str, list[int]]:
    hung = ""
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        hung = describe(job_pids(tag))
        kill_all(job_pids(tag))
        out, _ = proc.communicate()
        code = -9
    out += hung
    seconds = time.monotonic() - start
    left = job_pids(tag)
    # Left behind = still alive a while after the launcher returned: after an abort, ranks
    # that hydra's proxies signalled may still be exiting (seen at load average 25).
    deadline = time.monotonic() + LEFT_GRACE_S
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = job_pids(tag)
    kill_all(left)  # never leave anything behind, even when the test fails
    return code, seconds, out, left


#: Open MPI 5's crash after a death (docs/guide/fault-tolerance.md, "not survived"): a
#: process segfaults in Open MPI's progress engine, inside ``MPI_Comm_create_from_group``
#: (its nonblocking collective schedule on the revoked communicator aborted just before:
#: "NBC_Progress: an error 77"). Seen in about 1 of 15 jobs of a spare killed while standing
#: by, with two busy loops loading the 2-core machine (2026-12-06), and in CI.
OPENMPI_CREATE_CRASH = ("Signal: Segmentation fault", "ompi_comm_create_from_group")


#: What commlib raises where every attempt at a communicator's creation by name after a
#: failure (``commlib.fault.fault_tolerance.FTComm._create``: Open MPI's
#: ``MPI_Comm_create_from_group``, a PMIx group construction) stalled with every member
#: alive. Seen once, in CI (2026-12-06, the refill case of tests/test_elastic_spares.py
#: beside another test file): the survivors' creations after a spare joined stalled
#: attempt after attempt; in none of 47 local runs of that case, under heavier load.
OPENMPI_CREATE_STALL = re.compile(r"MPI Comm_create_from_group of .* did not complete within "
                                  r"\S+ s with no peer dead, attempt (\d+) of \1\b")


def known_library_crash(out: str) -> str | None:
    """What :data:`OPENMPI_CREATE_CRASH` or :data:`OPENMPI_CREATE_STALL` names, where a
    job's output ``out`` under Open MPI shows it (every line of the crash; the stall's
    last attempt given up); else None: any other crash or failure is a failure."""
    if mpi_impl().key != "openmpi":
        return None
    if all(s in out for s in OPENMPI_CREATE_CRASH):
        return "Open MPI 5's segfault inside MPI_Comm_create_from_group after a death"
    if OPENMPI_CREATE_STALL.search(out):
        return ("Open MPI 5's MPI_Comm_create_from_group stalling in every attempt after a "
                "death, every member alive")
    return None


#: What hydra prints where it ends a whole ``-disable-auto-cleanup`` job itself after a
#: death: its signal to a proxy that had just gone failed (seen once in about 60 jobs of
#: tests/test_elastic_spares.py, no rank finished; the same lines also end jobs whose ranks
#: all finished, with status 255, which the tests accept).
HYDRA_ENDED_JOB = ("HYD_pmcd_pmiserv_send_signal", "unable to send SIGUSR1 downstream",
                   "process manager error waiting for completion")


def known_launcher_failure(out: str, outdir: str) -> str | None:
    """Where MPICH's launcher ended the job itself (:data:`HYDRA_ENDED_JOB`) before any rank
    finished (no ``rank*.json`` in ``outdir``): what names it; else None."""
    if mpi_impl().key != "mpich" or not all(s in out for s in HYDRA_ENDED_JOB):
        return None
    if any(name.startswith("rank") for name in os.listdir(outdir)):
        return None
    return "hydra ending the job after a failed signal to a proxy (no rank finished)"


def run_job_past_known_crash(outdir: str, n: int, argv: list[str], timeout: float,
                             **kwargs) -> tuple[int, float, str, list[int]]:
    """:func:`run_job` with ``outdir`` (the job's results folder) as ``argv[1]``; a job
    that shows :func:`known_library_crash` or :func:`known_launcher_failure` is run once
    more, its first run's files moved
    to ``outdir/first-run`` (their segments must be gone all the same), and the second run
    is the one judged (a warning names the crash)."""
    import shutil
    import warnings
    status, seconds, out, left = run_job(n, [argv[0], outdir, *argv[1:]], timeout, **kwargs)
    crash = known_library_crash(out) or known_launcher_failure(out, outdir)
    if crash is None or left:
        return status, seconds, out, left
    first = os.path.join(outdir, "first-run")
    os.makedirs(first)
    for name in os.listdir(outdir):
        if name != "first-run":
            shutil.move(os.path.join(outdir, name), first)
    with open(os.path.join(first, "output.txt"), "w") as f:  # (whole, for a post-mortem)
        f.write(out)
    assert not leftover_shm(first), f"left {leftover_shm(first)} in /dev/shm ({crash})"
    warnings.warn(f"the job was run again: its first run showed {crash} (status {status})")
    return run_job(n, [argv[0], outdir, *argv[1:]], timeout, **kwargs)


def excerpt(out: str, tail: int = 2500, lines: int = 20) -> str:
    """A failed job's output for an assertion message: the first ``lines`` lines that name
    commlib (its own messages, in order: where the trouble began, which a tail alone loses
    under the launcher's and the library's noise) and the last ``tail`` characters."""
    mine = [line[:300] for line in out.splitlines()
            if "commlib" in line and not line.lstrip().startswith("File ")]
    if len(mine) <= lines and len(out) <= tail:
        return out
    return "first lines naming commlib:\n" + "\n".join(mine[:lines]) + \
        f"\n[... the output's last {tail} characters:]\n" + out[-tail:]


def describe(pids: list[int]) -> str:
    """The command lines of ``pids`` (for the message of a job that hung)."""
    lines = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            lines.append(f"{pid}: {cmdline[:200]}")
        except OSError:
            pass
    return "\n[still running at the timeout]\n" + "\n".join(lines) if lines else ""


def tag_job(env: dict) -> str:
    """Mark a job's processes: a variable every process of it inherits (hydra's proxies and
    the ranks each run in a session of their own, so a session does not find them)."""
    tag = uuid.uuid4().hex
    env[JOB_TAG] = tag
    return tag


def job_pids(tag: str) -> list[int]:
    """Processes (zombies excluded) whose environment carries the job tag ``tag``: the
    launcher, its proxies, the ranks and any rank they spawned."""
    needle = f"{JOB_TAG}={tag}".encode()
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        pid = int(stat.split("/")[2])
        try:
            with open(stat) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            found.append(pid)
    return found


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


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
    """In a job: record the shared-memory segments this rank maps (``shm{rank}.json``)."""
    from helpers import mpich_segments
    with open(os.path.join(outdir, f"shm{rank}.json"), "w") as f:
        json.dump(mpich_segments(), f)


def run_cluster_job(cluster, argv: list[str], timeout: float,
                    **env: str | None) -> tuple[int, float, str, list[int]]:
    """As :func:`run_job`, on a ``netsim`` cluster (one hydra proxy per emulated node,
    ``-disable-auto-cleanup``: a signal death ends the node, not the job), over UCX on the
    nodes' ``eth0`` (fault-tolerant mode cannot use libfabric's tcp provider, see
    :mod:`commlib.fault.fault_tolerance`)."""
    env.setdefault("MPIR_CVAR_CH4_NETMOD", "ucx")
    env.setdefault("UCX_NET_DEVICES", "eth0")
    cmd = cluster.prefix()
    at = next(i for i, c in enumerate(cmd) if os.path.basename(c) == "mpiexec")
    cmd = cmd[:at + 1] + ["-disable-auto-cleanup"] + cmd[at + 1:] + [sys.executable] + argv
    env.setdefault("PYTHONPATH", ROOT + os.pathsep + HERE)
    full = {k: v for k, v in dict(cluster.env, **env).items() if v is not None}
    full = {k: v for k, v in full.items()
            if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_"))}
    tag = tag_job(full)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full,
                            start_new_session=True, text=True, restore_signals=False)
    return _finish(proc, tag, timeout, start)


def reference_args(found: dict[int, dict]) -> tuple[str, str]:
    """``--victims`` and ``--reference`` of the run that shrinks where the survivors
    (results ``found``) did: the ranks that left at each recovery, the agreed steps."""
    first = next(iter(found.values()))
    victims, steps = [], []
    alive = list(range(first["world"]))
    for rec in first["recoveries"]:
        for r in sorted((r for r in alive if r not in rec["members"]), reverse=True):
            victims.append(r)
            steps.append(rec["step"])
        alive = rec["members"]
    return ",".join(map(str, victims)), ",".join(map(str, steps))


def run_store_job(n: int, argv: list[str], timeout: float,
                  **env: str | None) -> tuple[list[int], float, str, list[int]]:
    """Start ``n`` ranks by hand as a Kubernetes job would (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``; rank 0 hosts the store): the store-backed world of
    :mod:`commlib.mpi.launch`. Returns (each rank's status, -9 past ``timeout``; seconds; the
    output; pids of their sessions left alive)."""
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        port = str(s.getsockname()[1])
    base = {k: v for k, v in clean_env().items()
            if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in
            ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
             "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    env.setdefault("PYTHONPATH", ROOT + os.pathsep + HERE)
    base.update({k: v for k, v in env.items() if v is not None})
    tag = tag_job(base)
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable] + argv, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True,
                              env=dict(base, RANK=str(r), WORLD_SIZE=str(n),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(n)]
    codes, outs = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
            codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            out, _ = p.communicate()
            codes.append(-9)
        outs.append(out)
    seconds = time.monotonic() - start
    left = job_pids(tag)
    kill_all(left)
    return codes, seconds, "".join(outs), left


# -- references of elastic_train_program.py jobs (test_elastic, test_elastic_store) ----------

TRAIN_PROGRAM = os.path.join(HERE, "elastic_train_program.py")
TRAIN_STEPS = 30
#: The references the tests need when the survivors agree as expected (algorithm, victims,
#: agreed steps, scale_lr); the first test that needs one trains them all in one job
#: (``--scenarios``: a job is mostly startup). Another agreement gets a job of its own.
PLANNED = [("gradient_allreduce", "3", "12", True), ("gradient_allreduce", "3", "12", False),
           ("gradient_allreduce", "3", "13", False),
           ("gradient_allreduce", "3,2", "8,16", False),
           ("decentralized", "3", "12", False), ("local_sgd", "3", "12", False),
           ("diloco", "3", "12", False), ("diloco", "3", "14", False),
           ("streaming_diloco", "3", "11", False), ("streaming_diloco", "3", "12", False),
           ("powersgd", "3", "12", False), ("low_precision_decentralized", "3", "13", False),
           # (sparseloco and muloco: no exchange between outer steps, the survivors
           # learn of the death at a commit's fence and agree on step 13, or 12)
           ("qadam", "3", "12", False), ("sparseloco", "3", "12", False),
           ("sparseloco", "3", "13", False), ("muloco", "3", "12", False),
           ("muloco", "3", "13", False), ("demo", "3", "12", False),
           ("gradient_allreduce", "3,2", "12,12", False), ("gradient_allreduce", "", "", False)]
_references: dict[tuple, dict[int, dict]] = {}


def params(result: dict):
    """A result's final parameters (float64)."""
    import numpy as np
    return np.frombuffer(bytes.fromhex(result["params"]))


def _planned(tmp_path_factory, n: int, timeout: float) -> None:
    out_dir = tmp_path_factory.mktemp("references")
    scenarios = [{"name": f"s{i}", "algorithm": a, "victims": v, "steps": s, "scale_lr": lr}
                 for i, (a, v, s, lr) in enumerate(PLANNED)]
    status, _, out, left = run_job(n, [TRAIN_PROGRAM, str(out_dir), "--steps",
                                       str(TRAIN_STEPS), "--scenarios", json.dumps(scenarios)],
                                   timeout, keep_running=False, COMMLIB_TIMEOUT="60")
    assert status == 0 and not left, f"references failed ({status})\n{out[-3000:]}"
    for i, key in enumerate(PLANNED):
        _references[key + (None,)] = results(str(out_dir / f"s{i}"))


def reference(tmp_path_factory, algorithm: str, victims: str, steps: str,
              scale_lr: bool = False, cluster=None, n: int = 4,
              timeout: float = 150) -> dict[int, dict]:
    """The results of the ``n``-rank run without fault tolerance in which ranks ``victims``
    leave after the committed ``steps`` (``--reference``), one proxy per rank, or on the
    ``netsim`` ``cluster``; cached for the session."""
    key = (algorithm, victims, steps, scale_lr,
           None if cluster is None else (cluster.nodes, cluster.ranks_per_node))
    if cluster is None and n == 4 and key[:4] in PLANNED and key not in _references:
        _planned(tmp_path_factory, n, timeout)
    if key not in _references:
        out_dir = tmp_path_factory.mktemp("reference")
        argv = [TRAIN_PROGRAM, str(out_dir), "--steps", str(TRAIN_STEPS), "--victims",
                victims, "--reference", steps, "--algorithm", algorithm] + \
            (["--scale-lr"] if scale_lr else [])
        if cluster is None:
            status, _, out, left = run_job(n, argv, timeout, keep_running=False,
                                           COMMLIB_TIMEOUT="60")
        else:
            status, _, out, left = run_cluster_job(cluster, argv, timeout,
                                                   COMMLIB_TIMEOUT="60")
        assert status == 0 and not left, f"reference {key} failed ({status})\n{out[-3000:]}"
        _references[key] = results(str(out_dir))
    return _references[key]
