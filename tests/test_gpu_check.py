"""benchmarks/gpu_check.sh --dry-run, as CI runs it: every stage is present in the JSON,
nothing that can run on a CPU machine failed, what needs a GPU is reported as skipped.
The stage verdicts themselves are checked on tiny passing, failing and skipping test
files (the negative controls: a failing test must make its stage fail)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import clean_env, serial_only

ROOT = Path(__file__).resolve().parent.parent
STAGES = {"environment", "kernels_gpu", "kernels_cudasim", "gpu_mpi", "bench_kernels",
          "bench_allreduce", "ddp_free_cores", "shm_free_cores"}


def _gpu_check():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


@serial_only
@pytest.mark.timeout(300)
def test_dry_run_passes_and_reports_every_stage(tmp_path):
    env = clean_env(OUT=str(tmp_path), PYTHON=sys.executable, COMMLIB_TIMEOUT="60")
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=280)
    tail = done.stdout[-4000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    stages = report["stages"]
    assert done.returncode == 0, tail
    assert set(stages) == STAGES, tail
    assert report["mode"] == "dry-run" and report["ok"], tail
    assert report["summary"]["failed_stages"] == [] and report["summary"]["failed"] == 0
    assert stages["environment"]["status"] == "pass"
    assert "commlib" in report["environment"]["commlib_info"].lower()
    assert stages["kernels_gpu"]["status"] == "skipped"
    assert stages["kernels_cudasim"]["status"] == "pass"
    assert stages["kernels_cudasim"]["passed"] > 0
    # every simulated-CUDA kernel test ran (the suite runs them only here); the only skips are
    # test_kernels_api's checks of a machine without a GPU or the simulator
    sim = stages["kernels_cudasim"]
    assert not sim["skipped"] or sim["skip_reasons"] == "a GPU or the simulator is available here", sim
    # the mpiexec path ran: one junit report per rank, every GPU test skipped itself
    gpu = stages["gpu_mpi"]
    assert gpu["status"] == "skipped" and gpu["reports"] == 2 and gpu["skipped"] > 0, gpu
    assert {"collectives", "ddp_every_algorithm", "side_stream"} <= set(gpu["groups"])
    kernels = report["figures"]["kernels_vs_copy"]["results"][0]
    assert set(kernels["ops"]) >= {"copy", "quantize_minmax_uint8", "compress_sign"}
    assert all(kernels["matches_cpu"].values())
    allreduce = report["figures"]["compressed_allreduce"]["results"][0]["ops"]
    assert set(allreduce) == {"allreduce", "minmax_uint8", "sign1"}
    # issue 33's figures where cores are free: every contender of the DDP step timed, the
    # tier against raw MPI
    ddp = report["figures"]["ddp_free_cores"]["step_ms"]
    assert set(ddp) == {"compute only", "commlib", "torch DDP (gloo)",
                        "torch DDP (commlib backend)"} and all(v > 0 for v in ddp.values()), ddp
    shm = report["figures"]["shm_free_cores"]["results"]["allreduce"][0]
    assert shm["check"] and shm["shm"]["median_us"] > 0 and shm["mpi4py"]["median_us"] > 0
    assert (tmp_path / "gpu_check.log").stat().st_size > 0


@serial_only
@pytest.mark.timeout(200)
def test_stage_verdicts(tmp_path):
    gpu_check = _gpu_check()
    tests = tmp_path / "cases"
    tests.mkdir()
    (tests / "test_ok.py").write_text("def test_ok():\n    assert True\n")
    (tests / "test_bad.py").write_text("def test_bad():\n    assert False\n"
                                       "def test_ok():\n    pass\n")
    (tests / "test_skip.py").write_text("import pytest\n\n@pytest.mark.skip(reason='no GPU')\n"
                                        "def test_gpu():\n    pass\n")
    out = tmp_path / "out"
    out.mkdir()
    check = gpu_check.Check(out, dry_run=True, budget_s=150)
    ok = check.pytest_stage("ok", [str(tests / "test_ok.py")], 60)
    bad = check.pytest_stage("bad", [str(tests / "test_bad.py")], 60)
    skip = check.pytest_stage("skip", [str(tests / "test_skip.py")], 60)
    assert (ok["status"], ok["passed"], ok["failed"]) == ("pass", 1, 0)
    assert (bad["status"], bad["passed"], bad["failed"]) == ("fail", 1, 1)
    assert bad["failures"] and "test_bad" in bad["failures"][0]
    assert skip["status"] == "skipped" and "no GPU" in skip["reason"]
    saved = json.loads((out / "gpu_check.json").read_text())
    assert saved["ok"] is False and saved["summary"]["failed_stages"] == ["bad"]


def test_a_test_failing_on_one_rank_fails(tmp_path):
    gpu_check = _gpu_check()
    case = '<testsuite><testcase classname="t" name="test_x">{}</testcase></testsuite>'
    (tmp_path / "rank-0.xml").write_text(case.format(""))
    (tmp_path / "rank-1.xml").write_text(case.format('<failure message="boom"/>'))
    counts = gpu_check.junit_counts(sorted(tmp_path.glob("rank-*.xml")))
    assert (counts["passed"], counts["failed"], counts["reports"]) == (0, 1, 2)
    assert gpu_check.junit_counts(sorted(tmp_path.glob("rank-0.xml")))["passed"] == 1
