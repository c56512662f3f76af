"""The stages of ``benchmarks/gpu_check.sh``: run each with its own timeout, record the
test counts and figures in ``$OUT/gpu_check.json`` and every stage's output in
``$OUT/gpu_check.log``. One failing stage does not stop the others. See
docs/benchmarks/gpu-check.md for the JSON's fields.

    python benchmarks/gpu_check.py --out DIR [--dry-run] [--budget-s 420]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
# test name fragment -> group in the multi-rank GPU test stage
GROUPS = {"side_stream": "side_stream", "every_algorithm": "ddp_every_algorithm",
          "ddp_on_cuda": "ddp", "collectives": "collectives"}


class Check:
    def __init__(self, out: Path, dry_run: bool, budget_s: float) -> None:
        self.out, self.dry_run = out, dry_run
        self.deadline = time.monotonic() + budget_s
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_check."))
        self.log = open(out / "gpu_check.log", "a", buffering=1)
        self.report: dict[str, Any] = {
            "mode": "dry-run" if dry_run else "device",
            "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "budget_s": budget_s, "environment": {}, "stages": {}, "figures": {}}

    # -- running ------------------------------------------------------------------------
    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def run(self, cmd: list[str], timeout: float,
            env: dict | None = None) -> tuple[int, str, float]:
        """Run ``cmd`` in the repo root with its output into the log; returns (exit
        status, output, seconds); status 124 when it outlived ``timeout`` (its whole
        process group is killed)."""
        timeout = max(5.0, min(timeout, self.deadline - time.monotonic()))
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        shown = " ".join(a.strip().splitlines()[0] + " ..." if "\n" in a.strip() else a
                         for a in cmd)
        self.say(f"$ {shown}   (timeout {timeout:.0f} s)")
        start = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
        except OSError as exc:
            self.say(f"cannot start: {exc}")
            return 127, str(exc), 0.0
        try:
            out, _ = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            code = 124
            out += f"\n[gpu_check] killed after {timeout:.0f} s\n"
        self.log.write(out)
        return code, out, time.monotonic() - start

    def stage(self, name: str, status: str = "skipped", **fields: Any) -> dict:
        """Record stage ``name``: status pass, fail, timeout or skipped, and its fields."""
        entry = {"status": status, **{k: v for k, v in fields.items() if v != ""}}
        self.report["stages"][name] = entry
        counts = (f", {entry.get('passed', 0)} passed, {entry.get('failed', 0)} failed, "
                  f"{entry.get('errors', 0)} errors, {entry.get('skipped', 0)} skipped"
                  if "passed" in entry else "")
        self.say(f"=== {name}: {status}{counts}"
                 + (f" ({entry['reason']})" if entry.get("reason") else ""))
        self.save()
        return entry

    def save(self) -> None:
        stages = self.report["stages"].values()
        self.report["summary"] = {
            key: sum(s.get(key, 0) for s in stages)
            for key in ("passed", "failed", "errors", "skipped")}
        self.report["summary"]["failed_stages"] = [k for k, s in self.report["stages"].items()
                                                   if s["status"] in ("fail", "timeout")]
        self.report["summary"]["skipped_stages"] = [k for k, s in self.report["stages"].items()
                                                    if s["status"] == "skipped"]
        self.report["ok"] = not self.report["summary"]["failed_stages"]
        (self.out / "gpu_check.json").write_text(json.dumps(self.report, indent=1))

    # -- tools --------------------------------------------------------------------------
    def mpiexec(self) -> list[str]:
        here = Path(PY).parent / "mpiexec"
        exe = str(here) if here.exists() else (shutil.which("mpiexec") or "mpiexec")
        cmd = [exe, "-n", "2"]
        try:
            version = subprocess.run([exe, "--version"], capture_output=True, text=True,
                                     timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            version = ""
        if "Open MPI" in version or "OpenRTE" in version:
            cmd += ["--allow-run-as-root", "--oversubscribe"]
        return cmd

    def pytest_stage(self, name: str, files: list[str], timeout: float, ranks: int = 1,
                     env: dict | None = None, extra: list[str] | None = None,
                     must_run: bool = False) -> dict:
        """Run ``files`` under pytest (under ``mpiexec -n ranks`` when ranks > 1) and
        record the counts. ``must_run``: a stage whose tests all skipped themselves fails
        (on the GPU machine, a GPU test that skips means the GPU was not usable)."""
        junit = self.tmp / name
        junit.mkdir(exist_ok=True)
        args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", "-rfE",
                *(extra or []), *files]
        if ranks == 1:
            cmd = [PY, *args, f"--junitxml={junit}/rank-0.xml"]
        else:  # one report per rank: the shell expands the rank MPI gives each process
            rank = "${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}"
            inner = " ".join([shlex.quote(a) for a in (PY, *args, "--with-mpi", "--only-mpi")]
                             + [f"--junitxml={shlex.quote(str(junit))}/rank-{rank}.xml"])
            cmd = [*self.mpiexec(), "sh", "-c", inner]
        code, out, secs = self.run(cmd, timeout, env)
        counts = junit_counts(sorted(junit.glob("rank-*.xml")))
        status = ("timeout" if code == 124 else
                  "fail" if code not in (0, 5) or counts["failed"] or counts["errors"]
                  or not counts["reports"] else
                  "skipped" if counts["passed"] == 0 else "pass")
        reasons = "; ".join(sorted(counts.pop("skip_reasons")))[:500]
        if status == "skipped" and must_run:
            status, reasons = "fail", f"every test skipped itself on the GPU machine: {reasons}"
        reason = reasons if status in ("skipped", "fail") else ""
        if counts["skipped"] and status == "pass":
            counts["skip_reasons"] = reasons
        return self.stage(name, status, rc=code, seconds=round(secs, 1), ranks=ranks,
                          files=files, reason=reason, **counts)


def junit_counts(paths: list[Path]) -> dict:
    """Counts over every rank's junit report; a test counts as passed only if it passed on
    every rank, failed if it failed on any."""
    outcome: dict[str, str] = {}
    reasons: set[str] = set()
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (ET.ParseError, OSError):
            continue
        for case in root.iter("testcase"):
            test = f"{case.get('classname')}::{case.get('name')}"
            kinds = {child.tag for child in case}
            now = ("failed" if "failure" in kinds else "errors" if "error" in kinds else
                   "skipped" if "skipped" in kinds else "passed")
            for child in case:
                if child.tag == "skipped":
                    reasons.add(child.get("message", ""))
            rank_order = ["passed", "skipped", "errors", "failed"]
            if test not in outcome or rank_order.index(now) > rank_order.index(outcome[test]):
                outcome[test] = now
    counts = {k: sum(v == k for v in outcome.values())
              for k in ("passed", "failed", "errors", "skipped")}
    groups: dict[str, dict[str, int]] = {}
    for test, result in outcome.items():
        group = next((g for frag, g in GROUPS.items() if frag in test), None)
        if group is not None:
            groups.setdefault(group, {"passed": 0, "failed": 0, "errors": 0, "skipped": 0})
            groups[group][result] += 1
    return {**counts, "reports": len(paths), "groups": groups, "skip_reasons": reasons,
            "failures": sorted(t for t, r in outcome.items() if r in ("failed", "errors"))}


PROBE = """
import importlib.metadata as m, json, platform, sys
info = {"python": sys.version.split()[0] + " " + platform.machine(), "packages": {}}
for d in ("torch", "cupy-cuda13x", "cupy-cuda12x", "numba", "numba-cuda", "mpi4py", "mpich",
          "numpy", "pytest", "pytest-mpi", "pytest-timeout", "hypothesis"):
    try:
        info["packages"][d] = m.version(d)
    except Exception:
        pass
try:
    import torch
    info["torch_cuda"] = (f"torch {torch.__version__}, CUDA {torch.version.cuda}, device: "
                          f"{torch.cuda.is_available() and torch.cuda.get_device_name()}")
except Exception as exc:
    info["torch_cuda"] = f"torch: {exc!r}"
try:
    from mpi4py import MPI
    info["mpi"] = MPI.Get_library_version().strip()
except Exception as exc:
    info["mpi"] = f"mpi4py: {exc!r}"
print(json.dumps(info))
"""


def environment(check: Check) -> None:
    env: dict[str, Any] = check.report["environment"]
    probes = {
        "gpu": ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                "--format=csv,noheader"],
        "python": [PY, "-c", PROBE],   # one interpreter: versions, torch's CUDA, MPI
        "commlib_info": [PY, "-m", "commlib.tools.info"],
    }
    failed = []
    for key, cmd in probes.items():
        code, out, _ = check.run(cmd, 60)
        if key == "python" and code == 0:
            env.update(json.loads(out.strip().splitlines()[-1]))
        else:
            env[key] = out.strip()[-2000:]
        if code != 0 and key != "gpu":
            failed.append(key)
    installed = os.environ.get("GPU_CHECK_INSTALL_LOG")
    if installed and Path(installed).exists():
        env["install"] = Path(installed).read_text()[-3000:]
    check.stage("environment", "fail" if failed else "pass",
                reason=f"probes failed: {failed}" if failed else "")


def figures(check: Check, name: str, cmd: list[str], timeout: float, env: dict | None,
            key: str) -> None:
    path = check.tmp / f"{name}.json"
    code, _, secs = check.run(cmd + ["--json", str(path)], timeout, env)
    if path.exists():
        check.report["figures"][key] = json.loads(path.read_text())
    status = "timeout" if code == 124 else "pass" if code == 0 and path.exists() else "fail"
    check.stage(name, status, rc=code, seconds=round(secs, 1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU machine: CUDA simulator for the kernels, tiny sizes, "
                        "GPU-only stages skipped")
    p.add_argument("--budget-s", type=float, default=None,
                   help="all stages together (default 420 on a GPU, 240 dry)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    dry = args.dry_run
    check = Check(args.out, dry, args.budget_s or (240.0 if dry else 420.0))
    start = time.monotonic()
    sim = {"NUMBA_ENABLE_CUDASIM": "1"}
    mpi_env = {"COMMLIB_TIMEOUT": "60", "OMPI_ALLOW_RUN_AS_ROOT": "1",
               "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

    environment(check)
    if dry:
        check.stage("kernels_gpu", reason="dry run: needs a CUDA GPU")
    else:
        check.pytest_stage("kernels_gpu", ["tests/test_kernels_gpu.py"], 150, must_run=True)
    # test_kernels_api's slow test runs test_kernels_cudasim.py in a subprocess: run that
    # file here directly instead of twice
    check.pytest_stage("kernels_cudasim", ["tests/test_kernels_api.py",
                                           "tests/test_kernels_cudasim.py"], 120, env=sim,
                       extra=["--deselect",
                              "tests/test_kernels_api.py::test_cuda_simulator_matches_cpu"])
    # on a CPU machine every test of this file skips itself: the stage then shows
    # 'skipped', and the mpiexec path of the script was exercised all the same
    check.pytest_stage("gpu_mpi", ["tests/test_gpu.py"], 60 if dry else 200, ranks=2,
                       env=mpi_env, must_run=not dry)
    bk = [PY, "benchmarks/bench_kernels_gpu.py"]
    if dry:
        figures(check, "bench_kernels", bk + ["--device", "cpu", "--sizes-mib", "0.002",
                                              "--reps", "1", "--iters", "1", "--warmup", "0"],
                60, sim, "kernels_vs_copy")
    else:
        figures(check, "bench_kernels", bk + ["--sizes-mib", "1", "16", "64"], 120, None,
                "kernels_vs_copy")
    ba = [*check.mpiexec(), PY, "benchmarks/bench_allreduce_gpu.py"]
    if dry:
        figures(check, "bench_allreduce", ba + ["--device", "cpu", "--sizes-mib", "0.01",
                                                "--reps", "1", "--warmup", "0"],
                60, mpi_env, "compressed_allreduce")
    else:
        figures(check, "bench_allreduce", ba + ["--sizes-mib", "1", "16", "64"], 120,
                mpi_env, "compressed_allreduce")
    # Issue 33's DDP targets, decided where cores are free (2 ranks of one thread each on a
    # 16-core machine, the exchange on cores of its own; the development machine has 2):
    # commlib DDP, compute only, torch DDP over gloo and over the commlib backend on the
    # issue's MLP, then the shared-memory tier against raw MPI at 4 and 64 MiB. Last, and
    # cut short by the budget: the GPU stages above come first.
    pd = [*check.mpiexec(), PY, "benchmarks/profile_ddp.py", "--threads", "1"]
    bc = [*check.mpiexec(), PY, "benchmarks/bench_collectives.py", "--shm", "--ops",
          "allreduce", "--no-plot"]
    if dry:
        figures(check, "ddp_free_cores", pd + ["--layers", "64,64,10", "--batch", "8",
                                                "--steps", "2", "--reps", "1"],
                90, mpi_env, "ddp_free_cores")
        figures(check, "shm_free_cores", bc + ["--sizes", "4K", "--reps", "1"], 60, mpi_env,
                "shm_free_cores")
    else:
        figures(check, "ddp_free_cores", pd, 150, mpi_env, "ddp_free_cores")
        figures(check, "shm_free_cores", bc + ["--sizes", "4M", "64M", "--reps", "5"], 90,
                mpi_env, "shm_free_cores")
    check.report["elapsed_s"] = round(time.monotonic() - start, 1)
    check.save()
    s = check.report["summary"]
    check.say(f"=== gpu_check {check.report['mode']}: {s['passed']} passed, {s['failed']} "
              f"failed, {s['errors']} errors, {s['skipped']} skipped tests; stages failed: "
              f"{s['failed_stages'] or 'none'}; skipped: {s['skipped_stages'] or 'none'}; "
              f"{check.report['elapsed_s']} s")
    shutil.rmtree(check.tmp, ignore_errors=True)
    return 0 if check.report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
