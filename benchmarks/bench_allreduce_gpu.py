"""Compressed allreduce (min-max uint8, sign1) against the plain allreduce on GPU buffers.

Every rank holds a float32 torch tensor of each size on its GPU (ranks may share one
GPU); each sample is one call, all ranks meeting at a barrier first, and its time is the
slowest rank's (OSU style); the figure is the median. The input is restored from a copy
before every call, outside the timed region. ``--device cpu`` runs the same on CPU
tensors (a dry run of the script).

    mpiexec -n 2 python benchmarks/bench_allreduce_gpu.py --sizes-mib 1 16 64 --json out.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 64])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    import commlib
    from commlib import ReduceOp
    from commlib.primitives import CompressionState, compressed_allreduce
    torch.set_num_threads(1)
    rank, n = commlib.get_rank(), commlib.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        sync = torch.cuda.synchronize
    else:
        sync = lambda: None  # noqa: E731
    rows = []
    for mib in args.sizes_mib:
        numel = max(1, int(mib * 2**20) // 4)
        g = torch.Generator().manual_seed(rank)
        base = torch.randn(numel, generator=g).to(args.device)
        x = base.clone()
        state = CompressionState()
        ops = {
            "allreduce": lambda: commlib.allreduce(x, op=ReduceOp.AVG),
            "minmax_uint8": lambda: compressed_allreduce(x, method="minmax_uint8"),
            "sign1": lambda: compressed_allreduce(x, method="sign1", state=state),
        }
        times = {k: [] for k in ops}
        for rep in range(args.warmup + args.reps):
            for name, op in ops.items():
                x.copy_(base)
                sync()
                commlib.barrier()
                start = time.perf_counter()
                op()
                sync()
                elapsed = time.perf_counter() - start
                slowest = float(commlib.allreduce(np.array([elapsed]), op=ReduceOp.MAX)[0])
                if rep >= args.warmup:
                    times[name].append(slowest)
        med = {k: float(np.median(v)) for k, v in times.items()}
        nbytes = numel * 4
        row = {"size_mib": mib, "numel": numel,
               "ops": {k: {"median_s": med[k], "algbw_gbps": nbytes / med[k] / 1e9,
                           "speedup_vs_allreduce": med["allreduce"] / med[k]} for k in med}}
        rows.append(row)
        if rank == 0:
            print(f"{mib:g} MiB: " + ", ".join(
                f"{k} {v['median_s'] * 1e3:.3f} ms ({v['speedup_vs_allreduce']:.2f}x)"
                for k, v in row["ops"].items()), flush=True)
    if rank == 0 and args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": args.device, "ranks": n, "reps": args.reps,
                                         "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
