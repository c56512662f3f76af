"""Hugging Face Accelerate on commlib under ``mpiexec -n 2`` (``accelerate_program.py``):

* the recipe, ``init_process_group("commlib")`` before ``Accelerator()``: torch's DDP over
  commlib's backend;
* the runner, ``python -m commlib`` with no commlib line in the loop: commlib's DDP;

each with ``Accelerator()`` distributed on CPU without ``cpu=True`` (``MULTI_CPU``), the
parameters equal to torch's DDP over gloo after every step (float64, bit for bit at 2
ranks), and ``unwrap_model``/``save_model`` seeing through commlib's wrapper (no ``module.``
in the saved keys). Negative control: the same loop with one step's exchange skipped
(``accelerator.no_sync``) must differ from the reference from that step on.
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
        assert r["wrapper"] == ("torch.nn.parallel.distributed.DistributedDataParallel"
                                if mode == "recipe" else
                                "commlib.run.patch.DistributedDataParallel"), r
        assert r["steps"] == 6 and r["diffs"] == [0.0] * 6, r
        assert r["broken_diffs"][:2] == [0.0, 0.0] and min(r["broken_diffs"][2:]) > 1e-3, r
        assert r["unwrapped"] and r["saved_keys"] == KEYS, r
        assert r["explicit"] == {"unwrapped": True, "keys": KEYS}, r
