"""The runner, the entry point and the Lightning strategy under ``torchrun`` (2 ranks): the
processes torchrun starts form one MPI world through ``commlib.mpi.launch``.

* ``torchrun ... -m commlib --algorithm local_sgd mingpt/main.py``: every replica's checksum
  equal at every sync point, the snapshot holds it (the negative control of
  ``test_runner.py`` shows the same check failing without sync points);
* a script that never imports commlib says ``init_process_group("commlib")``;
* ``CommlibStrategy(local_sgd)`` keeps every replica identical in every checkpoint and at
  the end of ``fit`` (negative control: without its averaging they differ); the match with
  gloo's parameters is checked under mpiexec (``test_lightning.py``).
"""
import json
import os
import re
import subprocess
import sys

import pytest

from entry_points import autoload_pythonpath
from helpers import clean_env, serial_only, store_world_refusal
from test_lightning import identical
from test_runner import DESTROY, EPOCHS, MINGPT, assert_identical, snapshot_checksum, sync_points

pytest.importorskip("torch")
pytest.importorskip("tomllib")
pytest.importorskip("commlib.mpi.launch")
HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = serial_only
if store_world_refusal():
    pytest.skip(store_world_refusal(), allow_module_level=True)
N = 2


def torchrun(args, timeout=400, **env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={N}", "--monitor-interval=0.5", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=clean_env(OMP_NUM_THREADS="1", **env), start_new_session=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{out[-4000:]}"
    return out


def test_runner_under_torchrun(tmp_path):
    snapshot = tmp_path / "snapshot.pt"
    out = torchrun(["-m", "commlib", "--verbose", "--algorithm", "local_sgd",
                    "--algorithm-config", '{"sync_every": 5}', MINGPT,
                    f"trainer_config.snapshot_path={snapshot}",
                    f"trainer_config.max_epochs={EPOCHS}"])
    points = sync_points(out, N)
    assert [points[k][0] for k in sorted(points)] == ["epoch end"] * (2 * EPOCHS) + [DESTROY]
    assert_identical(points)
    assert [points[k][2] for k in sorted(points)] == [True, False] * EPOCHS + [False]
    assert snapshot_checksum(snapshot) == points[max(points)][1][0]


def test_script_without_commlib_import_under_torchrun(tmp_path):
    out = torchrun([os.path.join(HERE, "autoload_program.py")],
                   PYTHONPATH=autoload_pythonpath(tmp_path))
    reports = [json.loads(m) for m in re.findall(r"AUTOLOAD (\{.*\})", out)]
    assert sorted(r["rank"] for r in reports) == list(range(N)), out[-3000:]
    for r in reports:
        assert not r["commlib_at_import"] and r["sum"] == 3.0 and r["gathered"] == [0, 1]
        assert r["group"] == "ProcessGroupCommlib"


def test_lightning_strategy_under_torchrun(tmp_path):
    runs = ["commlib:local_sgd", "noavg:local_sgd"]
    out = torchrun([os.path.join(HERE, "lightning_program.py"), *runs],
                   LIGHTNING_PROGRAM_ROOT=str(tmp_path), LIGHTNING_DEVICES=str(N))
    reports = [json.loads(m) for m in re.findall(r"LIGHTNING (\{.*\})", out)]
    assert all(identical(reports, runs[0], N).values()), identical(reports, runs[0], N)
    assert not identical(reports, runs[1], N)["end"]  # negative control
