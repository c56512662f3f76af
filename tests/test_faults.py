"""Liveness: a rank that skips a collective, raises, exits or is killed ends the whole job
with a non-zero status within 30 s (COMMLIB_TIMEOUT=5), never a hang.

Each case launches ``mpiexec`` in a subprocess with an outer timeout; these tests run in the
serial session only (they start their own MPI jobs).
"""
import os

import pytest

from helpers import run_mpi, serial_only

PROGRAM = os.path.join(os.path.dirname(__file__), "fault_program.py")
pytestmark = serial_only


@pytest.mark.parametrize("mode", ["skip", "raise", "exit", "kill"])
def test_faulty_rank_ends_the_job(mode):
    code, seconds, out = run_mpi(3, [PROGRAM, mode], timeout=60, COMMLIB_TIMEOUT="5")
    assert code not in (0, -9), f"job exited {code}:\n{out}"
    assert seconds < 30, f"took {seconds:.1f} s:\n{out}"
    assert "finished normally" not in out or mode in ("skip", "exit", "kill")
    if mode == "raise":
        assert "rank 1 failed on purpose" in out and "uncaught exception" in out
    if mode in ("skip", "exit"):
        assert "did not complete within 5 s" in out and "allreduce #" in out


def test_mismatched_collective_times_out_and_names_it():
    code, seconds, out = run_mpi(2, [PROGRAM, "mismatch"], timeout=60, COMMLIB_TIMEOUT="5")
    assert code != 0 and seconds < 30, out


def test_mismatch_in_checking_mode_raises_everywhere():
    code, seconds, out = run_mpi(2, [PROGRAM, "mismatch"], timeout=60, COMMLIB_TIMEOUT="5",
                                 COMMLIB_CHECK="1")
    assert code != 0 and seconds < 30, out
    assert "CommError" in out and "disagree" in out


def test_healthy_job_exits_zero():
    code, seconds, out = run_mpi(3, [PROGRAM, "none"], timeout=60, COMMLIB_TIMEOUT="5")
    assert code == 0, out
    assert out.count("finished normally") == 3


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
