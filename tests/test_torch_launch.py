"""Launching torch.distributed programs: torchrun-style scripts run unchanged under
``mpiexec`` once they import commlib (env:// variables from MPI); a torchrun launch of a
commlib program forms one MPI world (commlib.mpi.launch; more in test_launch.py), and with
that turned off (``COMMLIB_LAUNCH=mpi``) fails fast on every rank, naming torchrun, the
reason and mpiexec; a plain singleton run still works; a job that never destroys its
process groups still exits 0.

Each case starts its own job with an outer timeout (serial session only).
"""
import os
import re
import signal
import subprocess
import sys
import time

from helpers import clean_env, run_mpi, serial_only

pytestmark = serial_only
HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "torch_env_program.py")
EXIT_PROGRAM = os.path.join(HERE, "torch_exit_program.py")
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "COMMLIB_LAUNCH",
              "COMMLIB_LAUNCH_PID")


def launch_env(**extra: str) -> dict:
    env = {k: v for k, v in clean_env(**extra).items() if k not in RENDEZVOUS or k in extra}
    env.setdefault("COMMLIB_TIMEOUT", "30")
    return env


def run(cmd: list, timeout: float, **extra: str) -> tuple:
    """(exit status, seconds, output, wall-clock end) of ``cmd``; killed at ``timeout``."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=launch_env(**extra), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -9, time.monotonic() - start, out, time.time()
    return proc.returncode, time.monotonic() - start, out, time.time()


def envs(out: str) -> dict:
    """rank -> the rendezvous variables the program printed."""
    return {int(m.group(1)): eval(m.group(2))  # noqa: S307 - our own program's dict output
            for m in re.finditer(r"rank (\d+) env (\{.*?\})", out)}


def test_torchrun_style_script_commlib_imported_first_default_backend(tmp_path):
    # No backend argument (gloo for CPU tensors), commlib imported before torch; the port
    # the user set is kept.
    from commlib.mpi.mpi_env import free_port
    for _ in range(3):  # a port free when chosen may be taken before the store binds it
        port = str(free_port())  # (another test file runs beside this one)
        code, seconds, out = run_mpi(2, [PROGRAM, "commlib-first", "default", str(tmp_path)],
                                     timeout=120, **{k: v for k, v in launch_env().items()
                                                     if k.startswith("COMMLIB")},
                                     MASTER_PORT=port)
        if code == 0 or "EADDRINUSE" not in out:
            break
    assert code == 0, out
    assert len(re.findall(r" ok backend=\S*gloo", out)) == 2, out
    seen = envs(out)
    assert sorted(seen) == [0, 1], out
    for rank, env in seen.items():
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["LOCAL_RANK"] == str(rank) and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == port


def test_torchrun_style_script_torch_first_commlib_backend_simulated_nodes(tmp_path):
    # backend="commlib", torch imported before commlib, 3 ranks on simulated nodes of 2
    # (COMMLIB_LOCAL_SIZE=2): MASTER_ADDR is then rank 0's routable address, not loopback.
    from commlib.mpi.mpi_env import host_addresses
    code, seconds, out = run_mpi(3, [PROGRAM, "torch-first", "commlib", str(tmp_path)],
                                 timeout=120, COMMLIB_TIMEOUT="30", COMMLIB_LOCAL_SIZE="2")
    assert code == 0, out
    assert len(re.findall(r" ok backend=\S*commlib", out)) == 3, out
    seen = envs(out)
    assert [seen[r]["LOCAL_RANK"] for r in range(3)] == ["0", "1", "0"], out
    assert [seen[r]["LOCAL_WORLD_SIZE"] for r in range(3)] == ["2", "2", "1"], out
    addrs = {env["MASTER_ADDR"] for env in seen.values()}
    assert len(addrs) == 1, out
    expected = host_addresses()[:1] or [None]
    if expected[0] is not None:
        assert addrs == set(expected), out


TRAIN = ("import sys, time\n"
         "sys.stdout.write(f'started {time.time()}\\n'); sys.stdout.flush()\n"
         "import commlib\n"
         "commlib.init()\n"
         "print('world', commlib.get_rank(), commlib.get_world_size(), flush=True)\n")


def torchrun_logs(tmp_path, **extra: str) -> tuple:
    """torchrun a 2-rank commlib program; (exit status, wall-clock end, output,
    {rank: (stdout, stderr)})."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    logs = tmp_path / "logs"
    # Each rank's output in its own file (--redirects 3); --monitor-interval 2: the agent
    # lets the second worker report before it stops it.
    code, seconds, out, end = run([torchrun, "--nproc_per_node=2", "--monitor-interval=2",
                                   "--log-dir", str(logs), "--redirects", "3", str(script)],
                                  timeout=120, **extra)
    ranks = {int(p.parent.name): ((p.parent / "stdout.log").read_text(), p.read_text())
             for p in logs.rglob("stderr.log")}
    return code, end, out, ranks


def test_torchrun_launch_with_the_store_world_off_fails_fast_naming_why(tmp_path):
    # COMMLIB_LAUNCH=mpi: MPI singletons, so init refuses on every rank, naming torchrun,
    # the reason and mpiexec. (Without it the same launch forms one world: test_launch.py.)
    code, end, out, ranks = torchrun_logs(tmp_path, COMMLIB_LAUNCH="mpi")
    assert code not in (0, -9), out
    assert sorted(ranks) == [0, 1], out
    starts = []
    for rank, (stdout, stderr) in ranks.items():
        starts += [float(s) for s in re.findall(r"started (\d+\.\d+)", stdout)]
        assert "world" not in stdout, stdout
        line = re.search(rf"CommError: commlib.init \(rank {rank} of WORLD_SIZE=2\).*", stderr)
        assert line, stderr
        for part in ("torchrun", "COMMLIB_LAUNCH=mpi", "mpiexec -n 2 python train.py"):
            assert part in line.group(0), line.group(0)
    assert len(starts) == 2, out
    assert end - min(starts) < 10, f"{end - min(starts):.1f} s after the ranks started:\n{out}"


def test_singleton_run_still_works(tmp_path):
    script = tmp_path / "alone.py"
    script.write_text("import numpy as np, commlib\n"
                      "commlib.init()\n"
                      "x = commlib.allreduce(np.ones(3))\n"
                      "import os\n"
                      "print('alone', commlib.get_world_size(), x.sum(), "
                      "os.environ.get('WORLD_SIZE'), flush=True)\n")
    code, seconds, out, _ = run([sys.executable, str(script)], timeout=60)
    assert code == 0, out
    assert "alone 1 3.0 None" in out, out


def test_job_exits_cleanly_without_destroying_its_groups():
    code, seconds, out = run_mpi(2, [EXIT_PROGRAM], timeout=60, COMMLIB_TIMEOUT="30")
    assert code == 0, out
    assert out.count("finished") == 2, out
    assert out.count("unwaited irecv at exit: [7.0, 7.0], unwaited all_reduce "
                     "[2.0, 2.0, 2.0, 2.0]") == 2, out
    assert "cancelled" not in out, out


STALE_PROGRAM = os.path.join(HERE, "stale_group_program.py")


def test_groups_torch_keeps_after_destroy_are_freed_before_exit():
    """torch.distributed.nn captures the default group in default arguments, so it outlives
    destroy_process_group() with its gloo threads, which then die during interpreter
    finalization and now and then abort the process. commlib frees such groups in its exit
    handler, while the interpreter is whole."""
    code, _, out = run_mpi(2, [STALE_PROGRAM, "show-before"], timeout=120)
    assert code == 0, out
    for rank in range(2):
        # The leak is real (so this test can fail): the threads outlive destroy and are
        # still there when the exit handlers start...
        leaked = re.search(rf"rank {rank} after destroy_process_group: \[(.+)\]", out)
        assert leaked and "pt_gloo_runloop" in leaked.group(1), out
        before = re.search(rf"rank {rank} before commlib's exit handler: \[(.+)\]", out)
        assert before and "pt_gloo_runloop" in before.group(1), out
        # ...and gone once commlib's handler ran.
        assert f"rank {rank} after commlib's exit handler: []" in out, out
