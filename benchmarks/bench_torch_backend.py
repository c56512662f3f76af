"""torch.distributed over MPI: torch's own DistributedDataParallel over the ``commlib``
backend against torch DDP over gloo, in the same job, and a small-message allreduce latency
table (the commlib backend, gloo and raw mpi4py).

    mpiexec -n 2 python benchmarks/bench_torch_backend.py [--width 1024 --depth 4]
        [--bucket-cap-mb 4] [--reps 7] [--max-size 16M] [--json PATH]

The default process group is made with ``init_process_group("commlib")`` from the env://
variables commlib sets at import; the gloo group is ``new_group(backend="gloo")`` over the
same ranks. Both DDP models start from the same weights and train on the same batches;
repetitions alternate between them (who goes first alternates too), so machine noise hits
both alike. A repetition's figures are each rank's median step time and mean step time
(total / steps), then the slowest rank's; the table reports the median over repetitions of
each. Latency: OSU-style blocks (barrier, a timed loop, the slowest rank's time per call),
median over blocks, implementations interleaved block by block.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import commlib  # noqa: E402  (before torch.distributed use: sets the env:// variables)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="torch DDP over the commlib backend vs over gloo, and allreduce "
                    "latency (commlib backend, gloo, mpi4py); run under mpiexec.",
        epilog="Sizes accept binary units: 4, 1K, 1MiB, 16M.")
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP (1024)")
    p.add_argument("--depth", type=int, default=4, help="hidden layers of the MLP (4)")
    p.add_argument("--batch", type=int, default=64, help="per-rank batch (64)")
    p.add_argument("--bucket-cap-mb", type=float, default=4.0,
                   help="DDP bucket size in MB (4: several buckets)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repetition (10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per repetition (3)")
    p.add_argument("--reps", type=int, default=7, help="repetitions per contender (7)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank (0: cores / ranks on the node)")
    p.add_argument("--min-size", type=C.parse_size, default=4,
                   help="smallest allreduce, bytes (4: one float32)")
    p.add_argument("--max-size", type=C.parse_size, default=16 << 20,
                   help="largest allreduce, bytes (16 MiB)")
    p.add_argument("--factor", type=int, default=4, choices=(2, 4), help="size step (x4)")
    p.add_argument("--block-ms", type=float, default=10.0,
                   help="target duration of one timed latency block (10 ms)")
    p.add_argument("--lat-reps", type=int, default=7, help="latency blocks per size (7)")
    p.add_argument("--no-ddp", action="store_true", help="skip the training-step comparison")
    p.add_argument("--no-latency", action="store_true", help="skip the latency table")
    p.add_argument("--json", type=Path, help="JSON output (default benchmarks/results/...)")
    return p.parse_args(argv)


def slowest(sync: Any, seconds: float) -> float:
    from mpi4py import MPI
    return sync.allreduce(seconds, op=MPI.MAX)


def bench_ddp(args: argparse.Namespace, groups: dict[str, Any], sync: Any) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from models import WideMLP

    g = torch.Generator().manual_seed(commlib.get_rank())
    x = torch.randn(args.batch, 784, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    steps: dict[str, Callable[[], None]] = {}
    for name, pg in groups.items():
        torch.manual_seed(0)
        model = DDP(WideMLP(width=args.width, depth=args.depth), process_group=pg,
                    bucket_cap_mb=args.bucket_cap_mb)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

        def step(model: Any = model, opt: Any = opt) -> None:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        steps[name] = step
    params = sum(p.numel() for p in WideMLP(width=args.width, depth=args.depth).parameters())
    times: dict[str, list[float]] = {name: [] for name in steps}
    means: dict[str, list[float]] = {name: [] for name in steps}
    for rep in range(args.reps):
        order = list(steps) if rep % 2 == 0 else list(steps)[::-1]
        for name in order:
            C.step_times(steps[name], args.warmup, 0)
            sync.Barrier()
            per_step = C.step_times(steps[name], 0, args.steps)
            times[name].append(slowest(sync, statistics.median(per_step)))
            means[name].append(slowest(sync, sum(per_step) / len(per_step)))
    summary = {name: {"median_s": statistics.median(v),
                      "mean_s": statistics.median(means[name]),
                      "reps_s": v, "reps_mean_s": means[name]} for name, v in times.items()}
    return {"parameters": params, "bucket_cap_mb": args.bucket_cap_mb, "steps": summary,
            "ratio_median": summary["commlib"]["median_s"] / summary["gloo"]["median_s"],
            "ratio_mean": summary["commlib"]["mean_s"] / summary["gloo"]["mean_s"]}


def bench_latency(args: argparse.Namespace, groups: dict[str, Any],
                  sync: Any) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    raw = MPI.COMM_WORLD.Dup()
    rows = []
    for size in C.size_range(args.min_size, args.max_size, args.factor):
        t = torch.zeros(max(1, size // 4), dtype=torch.float32)
        a = t.numpy()
        fns = {name: (lambda pg=pg: dist.all_reduce(t, group=pg))
               for name, pg in groups.items()}
        fns["mpi4py"] = lambda: raw.Allreduce(MPI.IN_PLACE, a)
        iters = C.calibrate(sync, list(fns.values()), 3, args.block_ms / 1e3, 1, 1000)
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for rep in range(args.lat_reps):
            order = list(fns) if rep % 2 == 0 else list(fns)[::-1]
            for name in order:
                samples[name].append(C.time_block(sync, fns[name], iters))
        row = {"bytes": t.numel() * 4, "iters": iters}
        row.update({f"{k}_us": statistics.median(v) * 1e6 for k, v in samples.items()})
        rows.append(row)
    raw.Free()
    return rows


def report(n: int, ddp: dict[str, Any] | None, latency: list | None) -> None:
    if ddp is not None:
        s = ddp["steps"]
        print(f"\ntorch DDP training step, {n} ranks, MLP of {ddp['parameters'] / 1e6:.2f} M "
              f"parameters, buckets of {ddp['bucket_cap_mb']:g} MB (slowest rank):")
        print(C.format_table(["backend", "median ms", "mean ms"],
                             [[k, C.fmt(v["median_s"] * 1e3), C.fmt(v["mean_s"] * 1e3)]
                              for k, v in s.items()]))
        print(f"step-time ratio commlib / gloo: median {ddp['ratio_median']:.3f}, "
              f"mean {ddp['ratio_mean']:.3f}")
    if latency:
        print(f"\nallreduce latency, {n} ranks, float32 (median of blocks, us):")
        print(C.format_table(
            ["size", "commlib backend", "gloo", "mpi4py", "commlib/gloo", "commlib-mpi4py"],
            [[C.fmt_size(r["bytes"]), C.fmt(r["commlib_us"], 1), C.fmt(r["gloo_us"], 1),
              C.fmt(r["mpi4py_us"], 1), C.fmt(r["commlib_us"] / r["gloo_us"], 3),
              C.fmt(r["commlib_us"] - r["mpi4py_us"], 1)] for r in latency]))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    if "WORLD_SIZE" not in os.environ:  # a singleton run: no launcher set the variables
        from commlib.mpi.mpi_env import free_port
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    dist.init_process_group("commlib")
    groups = {"commlib": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    n = dist.get_world_size()
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // commlib.get_local_size()))
    sync = MPI.COMM_WORLD.Dup()
    ddp = None if args.no_ddp else bench_ddp(args, groups, sync)
    latency = None if args.no_latency else bench_latency(args, groups, sync)
    if commlib.get_rank() == 0:
        report(n, ddp, latency)
        result = {"environment": C.environment(n), "args": vars(args),
                  "threads_per_rank": torch.get_num_threads(), "ddp": ddp, "latency": latency}
        path = C.write_json(args.json or C.default_path(f"torch_backend_{n}", ".json"), result)
        print(f"\nresults: {path}")
    sync.Free()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
