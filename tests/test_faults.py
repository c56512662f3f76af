"""Liveness: a rank that skips a collective, raises, exits or is killed ends the whole job
with a non-zero status within 30 s, never a hang; a job whose ranks all end, however far
apart, exits cleanly; no job leaves MPICH shared-memory segments in /dev/shm.

The faults that only the watchdog can catch (a rank alive but absent, a mismatch) run with
COMMLIB_TIMEOUT=5; the exit paths (sys.exit, an early end, an exception before init or
under torch's excepthook) run at the default settings (COMMLIB_TIMEOUT unset: 1800 s), so
they pass only if commlib ends the job by itself. Each case launches ``mpiexec`` in a
subprocess with an outer timeout; these tests run in the serial session only.
"""
import os
import re
import signal
import subprocess
import time

import pytest

from helpers import clean_env, leftover_segments, mpiexec_cmd, run_mpi, serial_only

HERE = os.path.dirname(__file__)
PROGRAM = os.path.join(HERE, "fault_program.py")
TORCH_PROGRAM = os.path.join(HERE, "torch_exit_program.py")
pytestmark = serial_only
DEFAULTS = {"COMMLIB_TIMEOUT": None}  # conftest's 120 s unset: commlib's default applies
CRASH = re.compile(r"Segmentation fault|terminate called|corrupted|core dumped|"
                   r"Fatal Python error")


def run_split(n: int, args: list, timeout: float, **env) -> tuple[int, float, str, str]:
    """(status, seconds, stdout, stderr) of ``mpiexec -n n python args``; killed at
    ``timeout`` (status -9)."""
    import sys
    start = time.monotonic()
    proc = subprocess.Popen(mpiexec_cmd(n) + [sys.executable] + args, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=clean_env(**env), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = -9
    return code, time.monotonic() - start, out, err


def no_segments_left(out: str) -> None:
    assert "SHM [" in out, out[-3000:]
    left = leftover_segments(out)
    assert not left, f"the job left {left} in /dev/shm:\n{out[-3000:]}"


@pytest.mark.parametrize("mode", ["skip", "raise", "kill"])
def test_faulty_rank_ends_the_job(mode):
    code, seconds, out = run_mpi(3, [PROGRAM, mode], timeout=60, COMMLIB_TIMEOUT="5")
    assert code not in (0, -9), f"job exited {code}:\n{out}"
    assert seconds < 30, f"took {seconds:.1f} s:\n{out}"
    assert "finished normally" not in out or mode in ("skip", "kill")
    if mode == "raise":
        assert "rank 1 failed on purpose" in out and "uncaught exception" in out
    if mode == "skip":
        assert "did not complete within 5 s" in out and "allreduce #" in out
    no_segments_left(out)


@pytest.mark.parametrize("mode,status,how", [
    ("exit", 3, "sys.exit(3)"),                 # while the others train
    ("exit0", 72, "sys.exit(0)"),               # status 0, the others still train
    ("early", 72, "its script ended"),          # fewer batches: its script simply ends
    ("exit_busy", 2, "sys.exit(2)"),            # the others compute alone meanwhile
    ("exit_shm", 4, "sys.exit(4)"),             # the others make the node's shm window
])
def test_rank_leaving_alone_ends_the_job_at_default_settings(mode, status, how):
    """Measured before: rank 1 waits in MPI_Finalize, the others in their collective or in
    their next one, for COMMLIB_TIMEOUT (30 minutes by default)."""
    code, seconds, out = run_mpi(3, [PROGRAM, mode], timeout=90, **DEFAULTS)
    assert code == status, f"status {code} after {seconds:.0f} s:\n{out[-3000:]}"
    assert seconds < 30, f"took {seconds:.1f} s:\n{out[-3000:]}"
    assert f"rank 1 left the program ({how}" in out, out[-3000:]
    assert "finished normally" not in out and not CRASH.search(out), out[-3000:]
    no_segments_left(out)


@pytest.mark.parametrize("mode,status,window", [("stagger", 0, "2"),
                                                ("stagger_fail", 1, None)])
def test_ranks_ending_apart_finish_cleanly(mode, status, window):
    """Negative control of the test above: ranks that end seconds apart, here farther apart
    (6 s) than the exit window (COMMLIB_EXIT_WINDOW=2), with nobody waiting in a
    collective, are not killed; a non-zero status within the window is the job's."""
    code, seconds, out = run_mpi(3, [PROGRAM, mode], timeout=90, COMMLIB_EXIT_WINDOW=window,
                                 **DEFAULTS)
    assert code == status, f"status {code}:\n{out[-3000:]}"
    assert out.count("finished normally") == 3, out[-3000:]
    assert "[commlib]" not in out and not CRASH.search(out), out[-3000:]
    no_segments_left(out)


def test_exception_under_torch_excepthook_reaches_stderr():
    """torch's _distributed_excepthook points sys.stderr at a StringIO around commlib's hook,
    which then aborts the job: the report must go to the real stderr (measured before:
    only "application called MPI_Abort")."""
    code, seconds, out, err = run_split(2, [TORCH_PROGRAM, "raise_after_init"], timeout=120,
                                        **DEFAULTS)
    assert code not in (0, -9), f"status {code}:\n{out}\n{err}"
    assert seconds < 60, seconds
    assert "rank 1: uncaught exception" in err, err[-3000:]
    assert "Traceback (most recent call last)" in err, err[-3000:]
    assert "RuntimeError: rank 1 failed on purpose under torch's excepthook" in err, err
    assert "finished" not in out
    no_segments_left(out)


def test_exception_before_init_ends_the_job():
    """Rank 1 raises after `import commlib`, before init; rank 0 waits for it in torch's
    rendezvous. Measured before: rank 1 waits in MPI_Finalize, rank 0 in the rendezvous,
    for torch's 30 minutes."""
    code, seconds, out, err = run_split(2, [TORCH_PROGRAM, "raise_before_init"], timeout=120,
                                        **DEFAULTS)
    assert code not in (0, -9), f"status {code}:\n{out}\n{err}"
    assert seconds < 60, seconds
    assert "rank 1: uncaught exception" in err, err[-3000:]
    assert "RuntimeError: rank 1 failed on purpose before init" in err, err[-3000:]
    assert "finished" not in out
    no_segments_left(out)


def test_mismatched_collective_times_out_and_names_it():
    code, seconds, out = run_mpi(2, [PROGRAM, "mismatch"], timeout=60, COMMLIB_TIMEOUT="5")
    assert code != 0 and seconds < 30, out
    no_segments_left(out)


def test_mismatch_in_checking_mode_raises_everywhere():
    code, seconds, out = run_mpi(2, [PROGRAM, "mismatch"], timeout=60, COMMLIB_TIMEOUT="5",
                                 COMMLIB_CHECK="1")
    assert code != 0 and seconds < 30, out
    assert "CommError" in out and "disagree" in out
    no_segments_left(out)


def test_healthy_job_exits_zero():
    code, seconds, out = run_mpi(3, [PROGRAM, "none"], timeout=60, **DEFAULTS)
    assert code == 0, out
    assert out.count("finished normally") == 3
    no_segments_left(out)


def test_timeout_set_at_run_time_applies(tmp_path):
    program = tmp_path / "late_timeout.py"
    program.write_text(
        "import time, numpy as np, commlib\n"
        "commlib.init()\n"
        "commlib.options.timeout = 3\n"
        "if commlib.get_rank() == 1:\n"
        "    time.sleep(60)\n"
        "commlib.allreduce(np.ones(4))\n")
    code, seconds, out = run_mpi(2, [str(program)], timeout=60)
    assert code != 0 and seconds < 20, out
    assert "did not complete within 3 s" in out
