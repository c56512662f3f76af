"""A rank leaving with ``sys.exit(1)`` under Lightning and Accelerate (issue 30, item 1 under
the frameworks): ``mpiexec -n 2``, commlib's default settings (``COMMLIB_TIMEOUT`` unset:
30 minutes), rank 1 leaves at step 3 while rank 0 trains on (``framework_exit_program.py``).
The job must end within the exit window (``COMMLIB_EXIT_WINDOW``, 10 s) of rank 1's exit,
with status 1, rank 0 not finishing, no crash, no segment left in ``/dev/shm``.

* Lightning, ``CommlibStrategy``: Lightning catches the ``SystemExit`` in ``fit``, runs its
  exception hooks and the strategy's teardown (the wrapper's ``close()``: no collective for
  this algorithm), then re-raises it;
* Accelerate, the one-edit recipe: torch's DDP over commlib's backend;
* Accelerate under the runner (``python -m commlib --algorithm local_sgd``): commlib's DDP;
  rank 0 waits in local_sgd's average. Before commit bbb2a23 the runner's end-of-script
  agreement, an allreduce rank 0 never joins, made this job hang for ``COMMLIB_TIMEOUT``
  (checked again with bbb2a23's two lines of ``sync.end_of_training`` reverted, the
  unclean-exit guard and the announcement: killed by a 70 s outer timeout).

The Lightning and recipe cases passed before any change here: the exit agreement
(:mod:`commlib.core.exits`) already bounds them; these tests keep it so.

Measured here (2 cores): 11.5-11.9 s from rank 1's exit to the job's end in each.
"""
import os
import re
import time

import pytest

from helpers import leftover_segments, require, run_mpi, serial_only

pytest.importorskip("torch")
HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "framework_exit_program.py")
pytestmark = serial_only
DEFAULTS = {"COMMLIB_TIMEOUT": None, "COMMLIB_EXIT_WINDOW": None, "OMP_NUM_THREADS": "1"}
WINDOW = 10.0  # COMMLIB_EXIT_WINDOW's default
CRASH = re.compile(r"Segmentation fault|terminate called|corrupted|core dumped|"
                   r"Fatal Python error")
CASES = {
    "lightning": ("lightning", [PROGRAM, "lightning", "gradient_allreduce"]),
    "accelerate_recipe": ("accelerate", [PROGRAM, "accelerate"]),
    "accelerate_runner": ("accelerate", ["-m", "commlib", "--algorithm", "local_sgd",
                                         PROGRAM, "accelerate_runner"]),
    # every collective through the node's shared-memory window: Lightning's teardown on
    # rank 1 frees the process group (and so the window) while rank 0 trains on; a
    # collective MPI_Win_free there hung the job until the outer timeout (122.6 s)
    "lightning_shm": ("lightning", [PROGRAM, "lightning", "gradient_allreduce"]),
}
ENV = {"lightning_shm": {"COMMLIB_SHM": "1"}}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rank_leaving_with_exit_1_under_a_framework_ends_the_job_within_the_window(case):
    framework, args = CASES[case]
    require(framework)
    code, _, out = run_mpi(2, args, timeout=150, **DEFAULTS, **ENV.get(case, {}))
    end = time.time()
    left = re.findall(r"LEAVING ([0-9.]+)", out)
    assert left, out[-3000:]
    after = end - float(left[0])
    print(f"EXIT {case}: the job ended {after:.1f} s after rank 1's sys.exit(1)")
    assert code == 1, f"status {code}:\n{out[-3000:]}"
    assert after < WINDOW + 5, f"{after} s after rank 1 left:\n{out[-3000:]}"
    assert "rank 1 left the program (sys.exit(1)" in out, out[-3000:]
    assert "rank 0 finished" not in out, out[-3000:]
    assert not CRASH.search(out), out[-3000:]
    assert "SHM [" in out, out[-3000:]
    assert not leftover_segments(out), out[-3000:]
