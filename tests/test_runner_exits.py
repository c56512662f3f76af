"""Exit paths under the runner (``mpiexec -n 2 python -m commlib script.py``), at commlib's
default settings (``COMMLIB_TIMEOUT`` unset: 30 minutes): a torch DDP script whose rank 1
leaves at step 3 while rank 0 trains on ends the job within the exit window
(``COMMLIB_EXIT_WINDOW``, 10 s) of rank 1's exit, with rank 1's status (72 for a status 0
while the others still train), never a hang, a crash or a segment left in ``/dev/shm``.

Measured before the fix (issue 30): a non-zero ``sys.exit`` under the runner, bare (nanoGPT)
or a framework's (hydra's, around minGPT-ddp's exception), ran the end-of-script agreement,
an allreduce rank 0 never joins: the job hung for ``COMMLIB_TIMEOUT``. Negative control:
ranks that end more than the exit window apart with nobody waiting end with status 0, the
replicas averaged at the end of the script.
"""
import os
import re

import pytest

from helpers import leftover_segments, run_mpi, serial_only

pytest.importorskip("torch")
HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "runner_exit_program.py")
pytestmark = serial_only
DEFAULTS = {"COMMLIB_TIMEOUT": None, "COMMLIB_EXIT_WINDOW": None, "OMP_NUM_THREADS": "1"}
WINDOW = 10.0  # COMMLIB_EXIT_WINDOW's default
CRASH = re.compile(r"Segmentation fault|terminate called|corrupted|core dumped|"
                   r"Fatal Python error")


def run(mode: str, *runner_args: str, **env):
    import time
    args = ["-m", "commlib", *runner_args, PROGRAM, mode]
    code, seconds, out = run_mpi(2, args, timeout=120, **{**DEFAULTS, **env})
    end = time.time()
    left = re.findall(r"LEAVING ([0-9.]+)", out)
    after = end - float(left[0]) if left else None
    return code, after, out


def check_clean(out: str) -> None:
    assert not CRASH.search(out), out[-3000:]
    assert "SHM [" in out, out[-3000:]
    left = leftover_segments(out)
    assert not left, f"the job left {left} in /dev/shm:\n{out[-3000:]}"


@pytest.mark.parametrize("mode,status,how", [
    ("exit1", 1, "sys.exit(1)"),          # nanoGPT's shape: a bare sys.exit(1)
    ("framework", 1, "sys.exit(1)"),      # hydra's shape: an exception turned into exit(1)
    ("exit0", 72, "sys.exit(0)"),         # one rank leaves with 0 while the other trains
])
def test_rank_leaving_under_the_runner_ends_the_job_within_the_exit_window(mode, status, how):
    code, after, out = run(mode)
    assert code == status, f"status {code}:\n{out[-3000:]}"
    assert after is not None and after < WINDOW + 5, f"{after} s after rank 1 left:\n{out[-3000:]}"
    assert f"rank 1 left the program ({how}" in out, out[-3000:]
    assert "rank 0 finished" not in out, out[-3000:]
    if mode == "framework":
        assert "RuntimeError: rank 1 failed on purpose" in out, out[-3000:]
    check_clean(out)


def test_uncaught_exception_under_the_runner_aborts_at_once():
    code, after, out = run("raise")
    assert code == 1, f"status {code}:\n{out[-3000:]}"
    assert after is not None and after < WINDOW, f"{after} s:\n{out[-3000:]}"
    assert "rank 1: uncaught exception" in out and "failed on purpose" in out, out[-3000:]
    check_clean(out)


@pytest.mark.parametrize("mode", ["none", "slow"])
def test_ranks_ending_apart_under_the_runner_finish_cleanly(mode):
    """Negative control: rank 1 reaches the end of its script (and tells rank 0 it is
    leaving) more than the exit window before rank 0, which evaluates alone meanwhile: not
    a fault. local_sgd's replicas (synchronized every 7 of 40 steps) are averaged at the end
    of the script on both ranks alike."""
    code, _, out = run(mode, "--algorithm", "local_sgd", "--algorithm-config",
                       '{"sync_every": 7}')
    assert code == 0, f"status {code}:\n{out[-3000:]}"
    assert out.count("finished") == 2 and "[commlib]" not in out, out[-3000:]
    ends = dict(re.findall(r"END rank (\d+) ([0-9a-f]{16})", out))
    assert sorted(ends) == ["0", "1"] and ends["0"] == ends["1"], out[-3000:]
    check_clean(out)
