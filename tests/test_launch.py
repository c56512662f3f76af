"""A real MPI world from any launcher's environment (commlib.mpi.launch).

torchrun (2 and 3 ranks; two agents with ``--nnodes 2`` and the c10d rendezvous; and
``--max-restarts 1`` after a SIGKILL), N processes started
with plain ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` (a Kubernetes
PyTorchJob's shape) and emulated Slurm step variables (two emulated nodes) each run
``launch_program.py``, which checks the world on every rank and trains. Every job must
exit 0 with no abort and leave none of its ``/dev/shm/mpich_*`` segments. Negative
controls: ``COMMLIB_LAUNCH=mpi`` (worlds of 1 and init refuses, naming why: here in one
process, under torchrun in test_torch_launch.py), mpi4py imported first, a child of a
rank, ``COMMLIB_LAUNCH=store`` without a job. Plus the pure pieces:
environment detection, Slurm host lists and ports, PMI mapping and wire format.

Each job runs under an outer timeout (serial session only).
"""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from commlib.mpi.launch import environment, pmi, space
from commlib.mpi.launch.world import fnv1a, shm_segments
from helpers import clean_env, mpi_impl, requires_store_world, serial_only

pytestmark = serial_only
HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "launch_program.py")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "GROUP_RANK", "COMMLIB_LAUNCH", "COMMLIB_LAUNCH_PID")
BAD = ("Abort", "terminate called", "Traceback", "Segmentation", "corrupted")


def base_env(**extra: str) -> dict:
    env = {k: v for k, v in clean_env().items()
           if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(COMMLIB_TIMEOUT="60", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run(cmd: list, timeout: float, env: dict) -> tuple:
    """(exit status, output) of ``cmd``; its process group is killed at ``timeout``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return -9, proc.communicate()[0]


def run_ranks(envs: list, args: list, timeout: float) -> tuple:
    """Start one process per environment (as a Kubernetes job or srun would); returns
    (exit statuses, combined output)."""
    procs = [subprocess.Popen([sys.executable] + args, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=e,
                              start_new_session=True) for e in envs]
    deadline, codes, outs = time.monotonic() + timeout, [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            out, _ = p.communicate()
            codes.append(-9)
        outs.append(out)
    return codes, "".join(outs)


def torchrun(n: int, args: list, timeout: float, *options: str, **extra: str) -> tuple:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={n}", "--monitor-interval=0.5", *options, PROGRAM, *args],
               timeout, base_env(**extra))


def check_job(out: str, n: int) -> str:
    """Every rank reported ok in one world; no abort; its shared memory is gone.
    Returns the world's PMI namespace name."""
    ok = re.findall(rf"rank (\d+) of {n} ok kvsname=(\S+)", out)
    assert sorted(int(r) for r, _ in ok) == list(range(n)), out
    names = {k for _, k in ok}
    assert len(names) == 1, out
    for word in BAD:
        assert word not in out, out
    name = names.pop()
    assert shm_segments(name) == [], (name, shm_segments(name))
    return name


@requires_store_world
@pytest.mark.parametrize("n", [2, 3])
def test_torchrun_forms_one_mpi_world(n):
    code, out = torchrun(n, ["store"], timeout=240)
    assert code == 0, out
    check_job(out, n)


@requires_store_world
def test_torchrun_two_agents_c10d_rendezvous_two_nodes():
    # torchrun --nnodes 2 --rdzv-backend c10d: two agents (two "nodes" on this host, told
    # apart by GROUP_RANK) of 2 workers each: one MPI world of 4 with two nodes of 2.
    port, env = free_port(), base_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two",
           "--monitor-interval=0.5", PROGRAM, "store"]
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, start_new_session=True) for _ in range(2)]
    outs, codes = [], []
    for agent in agents:
        try:
            outs.append(agent.communicate(timeout=240)[0])
            codes.append(agent.returncode)
        except subprocess.TimeoutExpired:
            for a in agents:
                os.killpg(a.pid, signal.SIGKILL)
            outs.append(agent.communicate()[0])
            codes.append(-9)
    out = "".join(outs)
    assert codes == [0, 0], out
    check_job(out, 4)
    assert sorted(re.findall(r"rank \d of 4 ok \S+ local=(\d+/\d+)", out)) == \
        ["0/2", "0/2", "1/2", "1/2"], out


@requires_store_world
def test_kubernetes_style_env_world():
    # No launcher agent: rank 0 hosts the TCPStore on MASTER_PORT (torch's env://
    # rendezvous then reuses it), no LOCAL_* variables, one host.
    n, port = 3, str(free_port())
    envs = [base_env(RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=port, EXPECT_LOCAL_SIZE=str(n)) for r in range(n)]
    codes, out = run_ranks(envs, [PROGRAM, "store"], timeout=240)
    assert codes == [0] * n, out
    check_job(out, n)


@requires_store_world
def test_emulated_slurm_step_two_nodes():
    # An srun step of 3 tasks on two emulated nodes (SLURM_NODEID 0, 0, 1): MPI sees two
    # nodes (shared memory within node 0, the netmod between them); no MASTER_* set: the
    # store is on the first host of the step's node list, at the port derived from the job
    # and step ids.
    job = next(j for j in range(4242, 9999) if _port_free(environment.slurm_port(str(j), "0")))
    n, nodes = 3, [0, 0, 1]
    envs = [base_env(SLURM_JOB_ID=str(job), SLURM_STEP_ID="0", SLURM_PROCID=str(r),
                     SLURM_NTASKS=str(n), SLURM_LOCALID=str(nodes[:r].count(nodes[r])),
                     SLURM_NODEID=str(nodes[r]), SLURM_STEP_NODELIST="localhost,localhost",
                     SLURM_TASKS_PER_NODE="2,1", EXPECT_LOCAL_SIZE=str(nodes.count(nodes[r])))
            for r in range(n)]
    codes, out = run_ranks(envs, [PROGRAM, "store"], timeout=240)
    assert codes == [0] * n, out
    check_job(out, n)
    assert re.findall(r"rank \d of 3 ok \S+ local=(\d+/\d+)", out).count("0/1") == 1, out


def _port_free(port: int) -> bool:
    try:
        with socket.socket() as s:
            s.bind(("", port))
        return True
    except OSError:
        return False


@requires_store_world
def test_torchrun_max_restarts_after_sigkill_forms_a_fresh_world():
    # Rank 1 kills itself after the first allreduce; torchrun stops rank 0 and restarts
    # both: the second attempt forms a new world under a new namespace (the old one's
    # shared memory, left by the killed ranks, is removed).
    code, out = torchrun(2, ["store", "--crash-rank", "1"], 300, "--max-restarts=1")
    assert code == 0, out
    name = check_job(out, 2)
    first = set(re.findall(r"attempt 0 kvsname=(\S+)", out))
    assert len(first) == 1 and name not in first, out
    assert shm_segments(first.pop()) == [], out
    killed = float(re.search(r"killing itself at (\S+)", out).group(1))
    again = max(float(t) for t in re.findall(r"attempt 1 \S+ first allreduce at (\S+)", out))
    print(f"SIGKILL -> first allreduce of the new 2-rank world: {again - killed:.1f} s")


@requires_store_world
def test_explicit_finalize_and_exit_status_in_a_store_world():
    # mpi4py's MPI.Finalize() before the end does not hang (libmpi's PMI finalize is then
    # answered in advance); the interpreter's own exit status comes through.
    script = ("import sys, commlib\nfrom mpi4py import MPI\ncommlib.barrier()\n"
              "MPI.Finalize()\nprint('finalized', MPI.Is_finalized(), flush=True)\n"
              "sys.exit(3)\n")
    n, port = 2, str(free_port())
    envs = [base_env(RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=port) for r in range(n)]
    codes, out = run_ranks(envs, ["-c", script], timeout=120)
    assert codes == [3] * n, out
    assert out.count("finalized True") == n, out
    for word in BAD:
        assert word not in out, out


@requires_store_world
@pytest.mark.parametrize("how, aborter", [("mpi4py", 1), ("commlib", 0)])
def test_an_abort_ends_every_rank_of_a_store_world(how, aborter):
    # Without an MPI launcher to kill the others, an abort reaches them through the store:
    # MPI_Abort(7) from mpi4py on rank 1, or commlib's own abort path (an uncaught
    # exception, exit code 1) on rank 0, which hosts the store. Every rank leaves at once
    # with the abort's code, or with 1 when it loses the store first (the host left).
    # (MPICH 5.0's MPI_Abort returns, leaving the end to the process manager: the
    # aborting rank then sleeps, so the others' barrier can only end by the abort.)
    if how == "mpi4py" and mpi_impl().pmi_abort_waits:
        pytest.skip(f"{mpi_impl().describe()}: MPI_Abort waits for the PMI server thread "
                    f"that mpi4py's Comm.Abort, holding the GIL, never lets run")
    fail = ("MPI.COMM_WORLD.Abort(7); time.sleep(60)" if how == "mpi4py"
            else "raise RuntimeError('boom')")
    script = ("import sys, time, commlib\nfrom mpi4py import MPI\ncommlib.init()\n"
              f"commlib.barrier()\nif MPI.COMM_WORLD.Get_rank() == {aborter}:\n"
              f"    {fail}\ncommlib.barrier()\n")
    code = 7 if how == "mpi4py" else 1
    n, port = 3, str(free_port())
    envs = [base_env(RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=port) for r in range(n)]
    start = time.monotonic()
    codes, out = run_ranks(envs, ["-c", script], timeout=120)
    seconds = time.monotonic() - start
    assert codes[aborter] == code, (codes, out)
    others = [c for r, c in enumerate(codes) if r != aborter]
    assert all(c in (code, 1) for c in others), (codes, out)
    followed = out.count(f"rank {aborter} called MPI_Abort (exit code {code})")
    lost = out.count("ended abnormally; leaving with exit code 1")
    assert followed + lost == n - 1 and followed >= 1, out
    assert seconds < 60, f"{seconds:.0f} s: a rank waited for its watchdog\n{out}"


@requires_store_world
@pytest.mark.parametrize("alone", [0, 1])
def test_a_rank_that_never_comes_is_named_within_the_timeout(alone):
    # WORLD_SIZE=2 but only rank `alone` starts. Rank 0 hosts the store and fails
    # MPI_Init, naming rank 1; rank 1 alone cannot reach rank 0's store: CommError at
    # import, naming the store's address. Both within COMMLIB_TIMEOUT (2 s) per wait.
    env = base_env(RANK=str(alone), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()), COMMLIB_TIMEOUT="2")
    code, out = run([sys.executable, "-c", "import commlib; print('formed')"], 120, env)
    assert code != 0 and "formed" not in out, out
    if alone == 0:
        assert "rank 0: ranks 1 of 2 did not join within 2 s (COMMLIB_TIMEOUT)" in out, out
    else:
        assert re.search(r"CommError: commlib \(rank 1 of 2, env\): could not form the MPI "
                         r"world from the launcher's store at 127\.0\.0\.1:\d+ \(hosted by "
                         r"rank 0\)", out), out


SINGLE = ("import os, sys\n{before}\nimport commlib\nfrom mpi4py import MPI\n"
          "print('world', MPI.COMM_WORLD.Get_size(), commlib.mpi.launch.current(), flush=True)\n"
          "try:\n    commlib.init()\nexcept commlib.CommError as e:\n"
          "    print('refused:', e, flush=True)\n")


@pytest.mark.parametrize("case", ["mpi4py-first", "child", "mpi-mode", "store-mode-no-job"])
def test_no_store_world_and_why(case):
    # One process each, no torch import: the reasons commlib gives for not forming a world.
    env = base_env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    before = ""
    if case == "mpi4py-first":
        before = "from mpi4py import MPI"
    elif case == "child":
        env["COMMLIB_LAUNCH_PID"] = "1"
    elif case == "mpi-mode":
        env["COMMLIB_LAUNCH"] = "mpi"
    else:
        env = base_env(COMMLIB_LAUNCH="store")
    code, out = run([sys.executable, "-c", SINGLE.format(before=before)], 60, env)
    if case == "store-mode-no-job":
        assert code != 0 and "COMMLIB_LAUNCH=store" in out and "no launcher variables" in out
        return
    assert code == 0 and "world 1 None" in out, out
    reason = {"mpi4py-first": "mpi4py.MPI was imported before commlib",
              "child": "a child process of the rank with process id 1",
              "mpi-mode": "COMMLIB_LAUNCH=mpi"}[case]
    line = re.search(r"refused: (.*)", out)
    assert line and reason in line.group(1) and "mpiexec -n 2" in line.group(1), out


# -- pure pieces ---------------------------------------------------------------------------

def test_detect_torchrun_env_and_slurm():
    tr = environment.detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                             "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                             "MASTER_ADDR": "h0", "MASTER_PORT": "29500",
                             "TORCHELASTIC_RUN_ID": "r/1", "TORCHELASTIC_RESTART_COUNT": "2",
                             "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (tr.launcher, tr.rank, tr.size, tr.local_rank, tr.local_size) == \
        ("torchrun", 3, 4, 1, 2)
    assert tr.use_agent_store and tr.node.endswith("/1") and tr.attempt == 2
    assert tr.namespace == "commlib/mpi/launch/r_1/2"
    assert tr.previous_namespaces() == ["commlib/mpi/launch/r_1/0", "commlib/mpi/launch/r_1/1"]
    k8s = environment.detect({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "m",
                              "MASTER_PORT": "23456"})
    assert k8s.launcher == "env" and not k8s.use_agent_store and k8s.attempt == 0
    slurm = environment.detect({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3",
                                "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
                                "SLURM_NODEID": "1", "SLURM_LOCALID": "1",
                                "SLURM_JOB_NODELIST": "gpu[07-09,12],login",
                                "SLURM_TASKS_PER_NODE": "4(x2)"})
    assert (slurm.rank, slurm.size, slurm.master_addr, slurm.local_size) == (5, 8, "gpu07", 4)
    assert slurm.master_port == environment.slurm_port("77", "3") == 10000 + (77 * 64 + 3)
    assert dict(slurm.exported) == {"MASTER_ADDR": "gpu07", "MASTER_PORT": str(slurm.master_port)}
    # torchrun inside an srun step: torchrun's variables win.
    both = environment.detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "a",
                               "MASTER_PORT": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                               "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "1"})
    assert both.launcher == "env" and both.rank == 1


@pytest.mark.parametrize("env, why", [
    ({"PMI_FD": "9", "RANK": "0", "WORLD_SIZE": "2"}, "MPI launcher (PMI_FD"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_RANK"),
    ({}, "no launcher variables"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "world of 1"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "is not a rank"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "MASTER_ADDR is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a"}, "MASTER_PORT is not set"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "1"}, "SLURM_STEP_ID is not set"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0"},
     "none of MASTER_ADDR"),
    ({"COMMLIB_LAUNCH": "mpi", "RANK": "0", "WORLD_SIZE": "2"}, "COMMLIB_LAUNCH=mpi"),
])
def test_detect_says_why_there_is_no_job(env, why):
    with pytest.raises(environment.NoJob, match=re.escape(why)):
        environment.detect(env)


def test_detect_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="COMMLIB_LAUNCH='torch'"):
        environment.detect({"COMMLIB_LAUNCH": "torch"})


def test_hostlists_mappings_and_wire_format():
    assert environment.expand_hostlist("n[1-3],m[08-10,15],x,a[1-2]-b[3-4]") == \
        ["n1", "n2", "n3", "m08", "m09", "m10", "m15", "x", "a1-b3", "a1-b4", "a2-b3", "a2-b4"]
    assert space.process_mapping(["a"] * 4) == ("(vector,(0,1,4))", [0] * 4)
    assert space.process_mapping(["a", "a", "b", "b", "c"])[0] == "(vector,(0,2,2),(2,1,1))"
    assert space.process_mapping(["a", "b", "a", "b"]) == \
        ("(vector,(0,2,1),(0,2,1))", [0, 1, 0, 1])
    assert space.format_ranks([7, 1, 2, 3, 9, 10]) == "1-3,7,9-10"
    assert space.format_ranks([]) == ""
    assert pmi.parse("cmd=put kvsname=k key=bc-0 value=a=b==") == \
        ("put", {"kvsname": "k", "key": "bc-0", "value": "a=b=="})
    assert pmi.format_reply("get_result", found="TRUE", value="x y\\z") == \
        b"cmd=get_result found=TRUE value=x\\ y\\\\z rc=0\n"
    assert fnv1a("") == 2166136261 and fnv1a("a") == 0xE40C292C
