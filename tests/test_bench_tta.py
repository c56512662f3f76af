"""The time-to-accuracy benchmark's --quick mode runs end to end and its JSON is coherent:
every contender's time to target is the first point of its own curve at the target, the
synchronous run reaches its own target, and the negative control (no communication,
label-skewed shards) is reported as never reaching it."""
import copy
import json
import os
import subprocess
import sys

import pytest

from helpers import require, serial_only

pytest.importorskip("torch")
require("sklearn")
pytestmark = serial_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_time_to_accuracy.py")
RUN_KEYS = {"ranks", "contenders", "seed", "target_acc", "emulation", "job_s"}
ROW_KEYS = {"steps", "wall_s", "samples_per_s", "mean_step_s", "median_step_s",
            "bytes_per_sample", "bus_bytes_per_sample", "steady_bus_bytes_per_sample",
            "final_acc_worst", "final_acc_mean", "time_to_target_s", "ttt_vs_torch_ddp",
            "curve"}


def check_run(run: dict) -> list[str]:
    """Problems of one (shape, model, seed) run; empty when coherent."""
    problems = []
    missing = RUN_KEYS - set(run)
    if missing:
        problems.append(f"run lacks {sorted(missing)}")
    target = run["target_acc"]
    for name, row in run["contenders"].items():
        if ROW_KEYS - set(row):
            problems.append(f"{name} lacks {sorted(ROW_KEYS - set(row))}")
            continue
        curve = row["curve"]
        walls = [p["wall_s"] for p in curve]
        if walls != sorted(walls) or walls[0] != 0.0:
            problems.append(f"{name}: wall times not increasing from 0")
        if any(len(p["acc"]) != run["ranks"] or p["acc_worst"] != min(p["acc"])
               for p in curve):
            problems.append(f"{name}: a point lacks a replica's accuracy")
        first = next((p["wall_s"] for p in curve if p["acc_worst"] >= target), None)
        if row["time_to_target_s"] != first:
            problems.append(f"{name}: time to target {row['time_to_target_s']} but the "
                            f"curve first reaches {target:.4f} at {first}")
        if abs(row["wall_s"] - walls[-1]) > 1e-12 or row["final_acc_worst"] != curve[-1]["acc_worst"]:
            problems.append(f"{name}: summary disagrees with the curve's last point")
        if row["mean_step_s"] <= 0 or row["median_step_s"] <= 0:
            problems.append(f"{name}: step times not positive")
    return problems


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("tta")
    path, png = out / "tta.json", out / "tta.png"
    env = dict(os.environ, COMMLIB_TIMEOUT="60")
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--json", str(path),
                           "--plot", str(png), "--timeout", "150"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert png.stat().st_size > 0
    return json.loads(path.read_text())


def test_quick_json_is_coherent(quick):
    assert quick["panels"], quick
    for key, panel in quick["panels"].items():
        assert panel["summary"]["_target_acc"] > 0.5, key
        for run in panel["runs"]:
            assert check_run(run) == [], (key, check_run(run))
            rows = run["contenders"]
            sync, control = rows["gradient_allreduce"], rows["control_nocomm"]
            assert sync["time_to_target_s"] is not None        # sync reaches its own target
            assert sync["bus_bytes_per_sample"] > 0 and sync["bytes_counted"]
            assert rows["torch_ddp_gloo"]["bytes_counted"] is False
            assert rows["torch_ddp_gloo"]["bus_bytes_per_sample"] > 0   # from the sizes
            # negative control: never communicates and cannot reach the target
            assert control["bus_bytes_per_sample"] == 0
            assert control["time_to_target_s"] is None
            assert panel["summary"]["control_nocomm"]["reached"] == 0


def test_checker_rejects_a_wrong_time_to_target(quick):
    """The checker's own negative control: a record that claims the control reached the
    target (or reports a later time than its curve shows) is rejected."""
    run = next(iter(quick["panels"].values()))["runs"][0]
    bad = copy.deepcopy(run)
    bad["contenders"]["control_nocomm"]["time_to_target_s"] = \
        bad["contenders"]["control_nocomm"]["curve"][-1]["wall_s"]
    assert any("control_nocomm" in p for p in check_run(bad))
    late = copy.deepcopy(run)
    late["contenders"]["gradient_allreduce"]["time_to_target_s"] = \
        late["contenders"]["gradient_allreduce"]["curve"][-1]["wall_s"] + 1.0
    assert any("gradient_allreduce" in p for p in check_run(late))
