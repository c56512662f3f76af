"""Hugging Face Accelerate on commlib under ``mpiexec -n 2`` (``accelerate_program.py``):

* the recipe, ``init_process_group("commlib")`` before ``Accelerator()``: torch's DDP over
  commlib's backend;
* the runner, ``python -m commlib`` with no commlib line in the loop: commlib's DDP;

each with ``Accelerator()`` distributed on CPU without ``cpu=True`` (``MULTI_CPU``) and
recording the default group's backend (``accelerator.state.backend``: it said ``gloo``
under the recipe before issue 30; ``gather`` works with it), the parameters equal to
torch's DDP over gloo after every step (float64, bit for bit at 2 ranks), and
``unwrap_model``/``save_model`` seeing through commlib's wrapper (no ``module.`` in the
saved keys). Negative control: the same loop with one step's exchange skipped
(``accelerator.no_sync``) must differ from the reference from that step on.

Relaxed replicas (``--algorithm local_sgd``, issue 30): ``save_model`` and ``save_state``
write the average of the replicas (each rank's measured, float64; before the fix, rank 0's
replica); the negative control, Accelerate's own ``save_model`` on the same replicas, must
write rank 0's; ``get_state_dict`` on the main process alone returns its replica and warns.
"""
import json
import os
import re

import pytest

from entry_points import autoload_pythonpath
from helpers import require, run_mpi, serial_only

pytest.importorskip("torch")
require("accelerate")
pytest.importorskip("tomllib")
PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "accelerate_program.py")
pytestmark = serial_only
KEYS = ["0.bias", "0.weight", "2.bias", "2.weight"]


@pytest.mark.parametrize("mode", ["recipe", "runner"])
def test_accelerate_matches_torch_ddp_over_gloo(tmp_path, mode):
    n = 2
    args = [PROGRAM, mode] if mode == "recipe" else ["-m", "commlib", PROGRAM, mode]
    code, _, out = run_mpi(n, args, timeout=400, OMP_NUM_THREADS="1",
                           ACCELERATE_PROGRAM_ROOT=str(tmp_path),
                           PYTHONPATH=autoload_pythonpath(tmp_path / "entry"))
    assert code == 0, f"exit status {code}; output ends with:\n{out[-4000:]}"
    reports = [json.loads(m) for m in re.findall(r"ACCELERATE (\{.*\})", out)]
    assert sorted(r["rank"] for r in reports) == list(range(n)), out[-3000:]
    for r in reports:
        assert r["processes"] == n and r["multi_cpu"], r
        assert r["backend"] == ("commlib" if mode == "recipe" else "gloo"), r
        assert r["state_backend"] == r["backend"] and r["gathered"] == list(range(n)), r
        assert r["wrapper"] == ("torch.nn.parallel.distributed.DistributedDataParallel"
                                if mode == "recipe" else
                                "commlib.run.patch.DistributedDataParallel"), r
        assert r["steps"] == 6 and r["diffs"] == [0.0] * 6, r
        assert r["broken_diffs"][:2] == [0.0, 0.0] and min(r["broken_diffs"][2:]) > 1e-3, r
        assert r["unwrapped"] and r["saved_keys"] == KEYS, r
        assert r["explicit"] == {"unwrapped": True, "keys": KEYS}, r


def test_accelerate_saves_the_average_of_relaxed_replicas(tmp_path):
    n = 2
    args = ["-m", "commlib", "--algorithm", "local_sgd", "--algorithm-config",
            '{"sync_every": 1000}', PROGRAM, "relaxed"]
    code, _, out = run_mpi(n, args, timeout=400, OMP_NUM_THREADS="1",
                           ACCELERATE_PROGRAM_ROOT=str(tmp_path))
    assert code == 0, f"exit status {code}; output ends with:\n{out[-4000:]}"
    reports = {r["rank"]: r for r in (json.loads(m) for m in
                                      re.findall(r"RELAXED (\{.*\})", out))}
    assert sorted(reports) == list(range(n)), out[-3000:]
    for rank, r in reports.items():
        assert r["algorithm"] == "local_sgd", r
        # The replicas differ before each save, so that saving one of them is visible.
        assert r["spread"] > 1e-2 and r["spread_2"] > 1e-2, r
        # Negative control: Accelerate's own save_model writes rank 0's replica.
        assert r["control_vs_rank0"] == 0.0 and r["control_vs_mean"] > 1e-2, r
        # The fix: the average of the replicas, and every rank trains on from it.
        assert r["save_model_vs_mean"] <= 1e-12 and r["spread_after_save"] == 0.0, r
        assert r["save_state_vs_mean"] <= 1e-12, r
        assert r["warned_saves"] == [], r
        # get_state_dict: no collective (rank 0 alone called it), its replica, one warning
        # (on the rank that took the state dict; once per wrapper: rank 0's control save
        # does not warn again).
        if rank == 0:
            assert r["get_state_dict_vs_own"] == 0.0, r
            assert len(r["warned_get_state_dict"]) == 1 and r["warned_control"] == 0, r
            assert "average_parameters()" in r["warned_get_state_dict"][0], r
            assert "rank 0" in r["warned_get_state_dict"][0], r
        else:
            assert r["warned_get_state_dict"] == [] and r["warned_control"] == 1, r
