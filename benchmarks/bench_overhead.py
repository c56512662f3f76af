"""commlib's per-call overhead on small allreduces, in one job: raw mpi4py, commlib with a
numpy array, commlib with a CPU torch tensor, and ``torch.distributed.all_reduce`` over the
``commlib`` backend (issue 33, section 2).

    mpiexec -n 2 python benchmarks/bench_overhead.py [--sizes 8 64K] [--reps 15]
        [--json PATH]

Per size: every contender is warmed up, then ``--reps`` OSU-style blocks (barrier, a timed
loop of calls on the same memory, the slowest rank's time per call) are timed in turn, the
order rotating from block to block so that machine noise hits every contender alike. The
table gives each contender's median and its added time over raw mpi4py (the median of the
per-round differences: contenders of one round ran back to back). The raw peer uses a
prebuilt ``[buffer, count, MPI.FLOAT]`` message on its own ``COMM_WORLD.Dup()``.

To compare two commits, run this file under each (``PYTHONPATH=<other worktree>`` puts
that tree's commlib first) in alternation and compare the ``added`` columns: each is a
difference within one job.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="commlib's added time per small allreduce over "
                                "raw mpi4py (numpy, torch, torch backend); run under mpiexec.",
                                epilog="Sizes accept binary units: 8, 64K.")
    p.add_argument("--sizes", type=C.parse_size, nargs="+", default=[8, 64 << 10],
                   help="buffer bytes per rank (8 B and 64 KiB)")
    p.add_argument("--reps", type=int, default=15, help="timed rounds (15)")
    p.add_argument("--block-ms", type=float, default=10.0, help="one timed block (10 ms)")
    p.add_argument("--no-torch", action="store_true", help="numpy contenders only")
    p.add_argument("--json", type=Path, help="JSON output (default: none)")
    p.add_argument("--summarize", nargs=2, metavar=("OLD_GLOB", "NEW_GLOB"),
                   help="no MPI: compare the --json files of two commits' alternating runs "
                        "(per run, each contender's best block minus raw mpi4py's; runs "
                        "whose raw best block is within 30%% of the quietest run's count "
                        "as quiet), print the table, write it with --json")
    return p.parse_args(argv)


def _num(x: float | None, sign: str) -> str:
    return "-" if x is None else f"{x:{sign}.2f}"


def summarize(old_glob: str, new_glob: str, out: Path | None) -> None:
    """Median over runs (all runs, and quiet runs only) of each contender's added time,
    per commit and size, from bench_overhead JSON files."""
    import glob
    import json
    runs = {tag: [json.loads(Path(f).read_text()) for f in sorted(glob.glob(pattern))]
            for tag, pattern in (("old", old_glob), ("new", new_glob))}
    raw_best = min(r["mpi4py"]["min_us"] for rs in runs.values() for d in rs
                   for r in d["rows"])
    table, result = [], {"raw_best_us": raw_best, "quiet_factor": 1.3, "rows": []}
    sizes = sorted({r["bytes"] for rs in runs.values() for d in rs for r in d["rows"]})
    for size in sizes:
        quiet_raw = min(r["mpi4py"]["min_us"] for rs in runs.values() for d in rs
                        for r in d["rows"] if r["bytes"] == size)
        for tag, rs in runs.items():
            rows = [r for d in rs for r in d["rows"] if r["bytes"] == size]
            quiet = [r for r in rows if r["mpi4py"]["min_us"] <= 1.3 * quiet_raw]
            entry: dict[str, Any] = {"bytes": size, "commit": tag, "runs": len(rows),
                                     "quiet_runs": len(quiet)}
            for name in [k for k in rows[0] if isinstance(rows[0][k], dict)]:
                def added(sel: list) -> float | None:
                    return statistics.median(r[name]["min_us"] - r["mpi4py"]["min_us"]
                                             for r in sel) if sel else None
                entry[name] = {"best_us_quiet": statistics.median(
                                   r[name]["min_us"] for r in quiet) if quiet else None,
                               "added_us_all": added(rows), "added_us_quiet": added(quiet)}
            result["rows"].append(entry)
            names = [k for k in entry if isinstance(entry[k], dict)]
            table.append([C.fmt_size(size), tag, f"{len(quiet)}/{len(rows)}"]
                         + [_num(entry[k]["best_us_quiet"], "") for k in names]
                         + [_num(entry[k]["added_us_quiet"], "+") for k in names
                            if k != "mpi4py"])
            heads = (["size", "commit", "quiet runs"] + [f"{k} us" for k in names]
                     + [f"{k} added" for k in names if k != "mpi4py"])
    print(C.format_table(heads, table, title="best block per run, median over the quiet "
                         "runs; added = median of (contender - mpi4py) per quiet run"))
    if out:
        C.write_json(out, result)


def contenders(count: int, use_torch: bool, raw: Any) -> dict[str, Callable[[], Any]]:
    import commlib
    # isort: split
    from mpi4py import MPI
    arr = np.zeros(count, np.float32)
    msg = [arr, count, MPI.FLOAT]
    fns: dict[str, Callable[[], Any]] = {
        "mpi4py": lambda: raw.Allreduce(MPI.IN_PLACE, msg, MPI.SUM),
        "commlib numpy": lambda: commlib.allreduce(arr),
    }
    if use_torch:
        import torch
        import torch.distributed as dist
        t = torch.zeros(count, dtype=torch.float32)
        t2 = torch.zeros(count, dtype=torch.float32)
        fns["commlib torch"] = lambda: commlib.allreduce(t)
        fns["torch backend"] = lambda: dist.all_reduce(t2)
    return fns


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.summarize:
        summarize(*args.summarize, args.json)
        return 0
    import commlib
    # isort: split
    from mpi4py import MPI
    commlib.init()
    use_torch = not args.no_torch
    if use_torch:
        import torch
        import torch.distributed as dist
        if "WORLD_SIZE" not in os.environ:  # a singleton run
            from commlib.mpi.mpi_env import free_port
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
        dist.init_process_group("commlib")
        torch.set_num_threads(1)
    raw, sync = MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Dup()
    n, rank = raw.Get_size(), raw.Get_rank()
    rows = []
    for size in args.sizes:
        count = max(1, size // 4)
        fns = contenders(count, use_torch, raw)
        iters = C.calibrate(sync, list(fns.values()), 30, args.block_ms / 1e3, 1, 5000)
        samples: dict[str, list[float]] = {k: [] for k in fns}
        names = list(fns)
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                samples[name].append(C.time_block(sync, fns[name], iters) * 1e6)
        row: dict[str, Any] = {"bytes": count * 4, "iters": iters}
        for name, s in samples.items():
            row[name] = {"median_us": statistics.median(s), "min_us": min(s),
                         "samples_us": s}
            if name != "mpi4py":
                row[name]["added_us"] = statistics.median(
                    a - b for a, b in zip(s, samples["mpi4py"]))
        rows.append(row)
    if rank == 0:
        names = list(rows[0]) if rows else []
        names = [k for k in names if k not in ("bytes", "iters")]
        table = [[C.fmt_size(r["bytes"])] + [f"{r[k]['median_us']:.2f}" for k in names]
                 + [f"{r[k]['added_us']:+.2f}" for k in names if k != "mpi4py"]
                 for r in rows]
        heads = (["size"] + [f"{k} us" for k in names]
                 + [f"{k} added" for k in names if k != "mpi4py"])
        print(C.format_table(heads, table, title=f"allreduce float32, {n} ranks: median us "
                             f"per call over {args.reps} rounds; added = median of the "
                             f"per-round differences to mpi4py"))
        if args.json:
            C.write_json(args.json, {"benchmark": "bench_overhead", "ranks": n,
                                     "commlib": str(Path(commlib.__file__).parent),
                                     "rows": rows, "environment": C.environment(n)})
    raw.Free()
    sync.Free()
    if use_torch:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
