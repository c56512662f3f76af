"""Bootstrap and allreduce under torchrun (commlib's store-backed world) vs mpiexec.

    python benchmarks/bench_launch.py [--ranks 2 4] [--rounds 3]

Runs ``tests/launch_program.py --bench`` under ``torchrun --standalone`` and under
``mpiexec``, interleaved round by round, and prints medians over rounds (of the per-rank
maximum) of: ``boot_s``, import commlib to the first allreduce (under torchrun this
includes importing torch for the store, printed apart as ``import_torch_s``, then the
store connection and ``MPI_Init`` through commlib's PMI server); the median 16 MiB
``MPI_Allreduce`` time. On a shared machine only the interleaved comparison means
anything.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = os.path.join(ROOT, "tests", "launch_program.py")
FIELDS = ("boot_s", "allreduce16MiB_ms", "import_torch_s", "store_s", "mpi_init_s")


def env() -> dict:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("PMI_", "HYDRA_", "MPI_", "SLURM_", "TORCHELASTIC_"))
         and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                       "MASTER_ADDR", "MASTER_PORT")}
    e.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return e


def run(launcher: str, n: int) -> dict:
    bindir = os.path.dirname(sys.executable)
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={n}", PROGRAM, "store", "--bench"]
    else:
        cmd = [os.path.join(bindir, "mpiexec"), "-n", str(n), sys.executable, PROGRAM, "mpi",
               "--bench"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{launcher} -n {n} failed:\n{out.stdout}\n{out.stderr}")
    values: dict[str, float] = {}
    for field in FIELDS:
        found = [float(v) for v in re.findall(rf"{field} (\d+\.\d+)", out.stdout)]
        if found:
            values[field] = max(found)
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[tuple, list[dict]] = {}
    for _ in range(args.rounds):
        for n in args.ranks:
            for launcher in ("torchrun", "mpiexec"):
                results.setdefault((launcher, n), []).append(run(launcher, n))
    print("| launcher | ranks | " + " | ".join(FIELDS) + " |")
    print("|---|---|" + "---|" * len(FIELDS))
    for (launcher, n), rows in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cells = []
        for field in FIELDS:
            vals = [r[field] for r in rows if field in r]
            cells.append(f"{statistics.median(vals):.3f}" if vals else "-")
        print(f"| {launcher} | {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
