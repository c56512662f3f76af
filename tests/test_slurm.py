"""Slurm, for real: a single-host Slurm cluster (tests/slurm_cluster.py: munged, slurmctld,
slurmd, all in a temporary directory) runs commlib jobs through ``srun`` and ``sbatch``.

* ``srun -n 4`` (the cluster's ``MpiDefault=none``: commlib forms the MPI world from a
  store on the step's first node) runs tests/slurm_program.py: Slurm's task ids are MPI's
  ranks, the 4 tasks share memory, ``init_process_group("commlib")`` all_reduce and
  all_gather are exact, torch's DDP over the commlib backend equals the float64 full-batch
  reference with identical replicas (negative control: unsynchronized replicas differ);
  then ``commlib.examples.train_digits`` runs as ``python -m`` runs it: it trains (the
  loss falls, the test accuracy is well above chance) with identical replicas.
* an ``sbatch --wait`` batch script of 4 tasks (the recipe of docs/guide/launching.md) whose steps are
  ``srun --mpi=pmi2 python -m commlib.examples.train_digits`` (Slurm's own PMI server,
  which MPICH's PMI-1 client uses; the same training), a step under ``WORLD_SIZE``,
  ``MASTER_ADDR`` and ``MASTER_PORT`` exported by the script (a common recipe: each task
  is still Slurm's, on the exported store) and a step that imports mpi4py before commlib
  (no world can be formed: every task must fail in ``commlib.init`` naming srun and the
  fix, not train alone).

* warm spares: ``srun -n 4 --kill-on-bad-exit=0`` of tests/elastic_train_program.py in
  fault-tolerant mode, 3 trainers and 1 spare, task 2 SIGKILLed: the spare joins and every
  trainer ends exact against the 3-rank run without failure (MPICH; negative control: a
  spare without the state fails the check).

Afterwards every daemon is stopped by its pid, nothing carrying the cluster's
``SLURM_CONF`` is left running, its directory is gone, and no MPICH segment appeared in
``/dev/shm``. Skipped (saying why) where Slurm or munge is not installed or not root.
"""
import os
import re
import socket
import textwrap
import time

import pytest

import commlib
import slurm_cluster
from commlib.core import runtime
from commlib.mpi.launch import environment
from commlib.mpi.launch.world import shm_segments
from elastic_common import TRAIN_PROGRAM, leftover_shm, results
from helpers import mpi_impl, requires_store_world, serial_only
from test_elastic_spares import reference  # noqa: F401 - the fixture (3 ranks, no failure)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PROGRAM = os.path.join(HERE, "slurm_program.py")
BAD = ("Traceback", "Segmentation", "terminate called", "corrupted", "Abort(")
REASON = slurm_cluster.why_not()
needs_slurm = pytest.mark.skipif(REASON is not None, reason=f"no Slurm cluster: {REASON}")
pytestmark = serial_only


def _segments() -> set:
    """The MPI library's segments in /dev/shm (commlib.mpi.shm: mpich_*, sm_segment.*)."""
    from commlib.mpi import shm
    kinds = tuple(p.rsplit("/", 1)[1] for p in shm.prefixes())
    return {n for n in os.listdir("/dev/shm") if kinds and n.startswith(kinds)} \
        if os.path.isdir("/dev/shm") else set()


def _mapped_anywhere() -> set:
    """The MPI library's segments some live process maps, by name (commlib.mpi.shm.mapped
    of each ``/proc/PID/maps``; one it cannot read counts as mapping none)."""
    from commlib.mpi import shm
    return {os.path.basename(path) for pid in os.listdir("/proc") if pid.isdigit()
            for path, _, _ in shm.mapped(f"/proc/{pid}/maps")}


def _unclaimed(names: set, grace_s: float = 15.0) -> set:
    """Of ``names``, those still in /dev/shm that no live process maps, after waiting up
    to ``grace_s`` for them to go: the segments this module's jobs left behind. (The other
    xdist worker's jobs run meanwhile; a segment of theirs is named until every rank of
    its job maps it, and is theirs to answer for.)"""
    deadline = time.monotonic() + grace_s
    while True:
        mapped = _mapped_anywhere()
        left = {n for n in names if os.path.exists(os.path.join("/dev/shm", n))
                and n not in mapped}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster():
    before = _segments()
    c = slurm_cluster.SlurmCluster()
    c.start()
    directory, pids = c.dir, dict(c.pids)
    try:
        yield c
    finally:
        killed = c.stop()
    # Nothing left: the daemons ended on SIGTERM, no task or slurmstepd of this cluster
    # runs, its files are gone, no MPICH segment of its jobs stayed in /dev/shm.
    assert killed == [], f"had to be killed: {killed}"
    assert not any(slurm_cluster._alive(p) for p in pids.values()), pids
    assert c.leftovers() == [] and not os.path.exists(directory)
    left = _unclaimed(_segments() - before)
    if os.environ.get("ALLOW_SHM_LEFTOVERS") != "1":  # as tests/run_all.sh
        assert not left, f"MPI segments left in /dev/shm: {sorted(left)}"


def job_env(**extra: str) -> dict:
    env = {"PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "COMMLIB_TIMEOUT": "120"}
    env.update(extra)
    return env


def check_tasks(out: str, n: int, kind: str) -> str:
    """Every task reported ok, in one world of the expected kind; returns the DDP replica
    checksum (the same on every task)."""
    ok = re.findall(rf"slurm task (\d+) of {n} ok {kind} node (\d+)/{n} kvsname=(\S+) "
                    rf"ddp replicas (\w+)", out)
    assert sorted(int(t) for t, *_ in ok) == list(range(n)), out
    assert sorted(int(r) for _, r, *_ in ok) == list(range(n)), out  # one node of n tasks
    names, sums = {k for *_, k, _ in ok}, {s for *_, s in ok}
    assert len(names) == 1 and len(sums) == 1, out
    name = names.pop()
    assert (name == "None") == (kind == "pmi"), out
    if name != "None":
        assert shm_segments(name) == [], shm_segments(name)
    for word in BAD:
        assert word not in out, out
    return sums.pop()


def check_digits(out: str) -> None:
    """train_digits' own report (rank 0): 4 ranks, the loss falls, it learned."""
    assert re.search(r"commlib \S+: 4 ranks, algorithm GradientAllReduce", out), out
    losses = [float(x) for x in re.findall(r"epoch +\d/2 +loss (\S+)", out)]
    assert len(losses) == 2 and losses[1] < 0.5 * losses[0], out
    accuracy = float(re.search(r"test accuracy (\S+)", out).group(1))
    assert accuracy > 0.8, out
    for word in BAD:
        assert word not in out, out


@needs_slurm
def test_srun_four_tasks_torch_backend_and_train_digits(cluster):
    """``srun -n 4`` (MpiDefault=none: the store-backed world) where libmpi can be given a
    world from a store; on Open MPI that step is refused on every task, naming
    ``srun --mpi=pmix``, and ``srun --mpi=pmix`` forms the world (Slurm's PMIx server)."""
    impl = mpi_impl()
    args = [PROGRAM, "store", "--digits", "--epochs", "2", "--no-progress"]
    if not impl.store_world:
        code, out = cluster.run(["srun", "-n", "2", "python", PROGRAM, "store"], timeout=120,
                                **job_env())
        assert code != 0 and "ok store" not in out, out
        assert out.count("srun --mpi=pmix") >= 2 and out.count("cannot join") >= 2, out
        args[1] = "pmi"
    plugin = [] if impl.store_world else [f"--mpi={impl.slurm_mpi_plugins[0]}"]
    code, out = cluster.run(["srun", *plugin, "-n", "4", "python", *args], timeout=300,
                            **job_env())
    print(out)
    assert code == 0, out
    check_tasks(out, 4, args[1])
    check_digits(out)
    replicas = set(re.findall(r"digits replicas (\w+)", out))
    assert len(replicas) == 1 and out.count("digits replicas") == 4, out


@needs_slurm
@requires_store_world
def test_sbatch_script_pmi2_exported_variables_and_a_world_that_cannot_form(cluster, tmp_path):
    log = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    port = free_port()
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --job-name=commlib-test
        #SBATCH --ntasks=4
        #SBATCH --output={log}
        echo "batch shell: SLURM_NTASKS=$SLURM_NTASKS"
        srun --mpi=pmi2 python -m commlib.examples.train_digits --epochs 2 --no-progress
        echo "step 0 exit $?"
        export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
        export MASTER_PORT={port} WORLD_SIZE=2
        srun -n 2 python -c "{EXPORTED}"
        echo "step 1 exit $?"
        srun -n 2 python -c "from mpi4py import MPI; import commlib; commlib.init(); print('TRAINED-ALONE')"
        echo "step 2 exit $?"
        """))
    code, out = cluster.run(["sbatch", "--wait", str(script)], timeout=300, **job_env())
    text = log.read_text() if log.exists() else ""
    print(out + text)
    assert code == 0 and "batch shell: SLURM_NTASKS=4" in text, out + text
    step0, step1, step2 = re.split(r"step \d exit ", text)[:3]
    assert "step 0 exit 0\n" in text and "step 1 exit 0\n" in text, text
    check_digits(step0)
    # The batch script exported WORLD_SIZE, MASTER_ADDR, MASTER_PORT (a common recipe):
    # each task is still Slurm's (SLURM_PROCID), on the exported store address.
    got = sorted(re.findall(r"exported world (\d) rank (\d) task (\d) (\S+) (\S+):(\d+)", step1))
    assert got == [("2", r, r, "slurm", cluster.node, str(port)) for r in "01"], text
    assert "step 2 exit 0" not in text and "TRAINED-ALONE" not in text, text
    assert len(re.findall(r"this process was started by srun, but MPI sees a world of 1 "
                          r"process.*mpi4py\.MPI was imported before commlib", step2)) == 2, text
    assert "srun --mpi=none python -c" in step2, text


@needs_slurm
@pytest.mark.skipif(mpi_impl().key != "mpich",
                    reason="fault-tolerant mode in the store-backed world is MPICH's")
@pytest.mark.parametrize("control", [False, True], ids=["exact", "spare-without-state"])
def test_srun_a_warm_spare_replaces_a_killed_task(cluster, tmp_path,
                                                  reference,  # noqa: F811 - the fixture
                                                  control):
    """Warm spares under Slurm (issue 34): ``srun -n 4 --kill-on-bad-exit=0`` (Slurm leaves
    the other tasks running when one dies) of tests/elastic_train_program.py in
    fault-tolerant mode (the store-backed world), ``run(spares=1)``: task 2 SIGKILLed
    mid-backward at step 12, spare 3 joins ([0, 1, 3]) and every trainer ends bit for bit
    equal to the 3-rank run without failure (test_elastic_spares' reference). Negative
    control: a spare that keeps its own model (``--skip-spare-state``) must make the same
    check fail."""
    from test_elastic_spares import STEPS, check, merges
    argv = ["srun", "-n", "4", "--kill-on-bad-exit=0", "python", TRAIN_PROGRAM, str(tmp_path),
            "--steps", str(STEPS), "--fault", "kill", "--victims", "2", "--at", "12",
            "--spares", "1"] + (["--skip-spare-state"] if control else [])
    code, out = cluster.run(argv, timeout=240, **job_env(
        PYTHONPATH=REPO + os.pathsep + HERE, COMMLIB_FAULT_TOLERANT="1",
        COMMLIB_TIMEOUT="60"))
    assert code != -9, f"hang\n{out[-3000:]}"
    assert "task 2: Killed" in out, out[-3000:]
    found = results(str(tmp_path))
    check(found, [0, 1, 3], reference, 0, out, expected={}, exact=not control)
    for rank, r in found.items():
        assert merges(r) == [([0, 1, 3], [3])], (rank, r["recoveries"])
    assert not leftover_shm(str(tmp_path)), leftover_shm(str(tmp_path))


EXPORTED = ("import commlib, os; commlib.init(); j = commlib.mpi.launch.current().job; "
            "print('exported world', commlib.get_world_size(), 'rank', commlib.get_rank(), "
            "'task', os.environ['SLURM_PROCID'], j.launcher, f'{j.master_addr}:{j.master_port}',"
            " flush=True)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_detect_an_srun_task_under_exported_job_variables():
    # No Slurm needed: WORLD_SIZE/MASTER_ADDR/MASTER_PORT exported by the batch script
    # for the whole job, no RANK: the task is Slurm's, on the exported store; a WORLD_SIZE
    # that is not the step's task count is refused, naming both.
    step = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "1", "SLURM_PROCID": "1",
            "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NODELIST": "n[3-4]",
            "WORLD_SIZE": "2", "MASTER_ADDR": "n3", "MASTER_PORT": "29500"}
    job = environment.detect(step)
    assert (job.launcher, job.rank, job.size, job.master_addr, job.master_port) == \
        ("slurm", 1, 2, "n3", 29500) and job.exported == ()
    with pytest.raises(environment.NoJob, match=r"WORLD_SIZE='4' .* the srun step has 2 tasks"):
        environment.detect(dict(step, WORLD_SIZE="4"))
    # A per-process RANK (torchrun inside srun) still wins.
    assert environment.detect(dict(step, RANK="0")).launcher == "env"


def test_launcher_check_names_srun_and_the_fix():
    # No Slurm needed: an srun step of 4 tasks in which MPI sees a world of one (this
    # process) must refuse, naming the task, the step and the srun options; not in a
    # batch shell (no SLURM_STEP_ID), a step of one task, or with COMMLIB_LAUNCH=mpi
    # (tasks meant to run alone).
    step = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "2", "SLURM_PROCID": "3",
            "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4"}
    if commlib.mpi.launch.current() is not None or \
            __import__("mpi4py.MPI").MPI.COMM_WORLD.Get_size() != 1:
        pytest.skip("needs a world of one MPI process")
    with pytest.raises(commlib.CommError) as info:
        runtime.check_launcher(step)
    text = str(info.value)
    assert "task 3 of 4 of Slurm step 77.2" in text and "started by srun" in text, text
    assert "COMMLIB_LAUNCH=mpi" in text, text
    for plugin in mpi_impl().slurm_mpi_plugins:  # the plugins that form this MPI's world
        assert f"--mpi={plugin}" in text, text
    with pytest.raises(commlib.CommError, match="task 0 of 2"):
        runtime.check_launcher({"SLURM_JOB_ID": "7", "SLURM_STEPID": "0",
                                "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    with pytest.raises(commlib.CommError, match="task 3 of 4 of Slurm step 77.2"):
        runtime.check_launcher(dict(step, WORLD_SIZE="4"))  # exported by the batch script
    batch = {k: v for k, v in step.items() if k not in ("SLURM_STEP_ID",
                                                       "SLURM_STEP_NUM_TASKS")}
    for fine in (batch, dict(step, SLURM_STEP_NUM_TASKS="1"), dict(step, COMMLIB_LAUNCH="mpi")):
        runtime.check_launcher(fine)
