"""Where a commlib DDP step goes: forward, backward, each bucket's exchange, the copies of
gradients into buckets, the optimizer step, next to the same step without communication
and torch DDP over gloo and over the commlib backend, in one mpiexec job (issue 33 section 3).

    mpiexec -n 2 python benchmarks/profile_ddp.py [--layers 1024,4096,4096,1024,10]
        [--batch 32] [--bucket-cap-mb 25] [--steps 15] [--reps 3] [--json PATH]

The model is the MLP of the issue (25 M parameters, 100 MB of float32 gradients) unless
``--layers`` says otherwise; SGD with momentum; one torch thread per rank (``--threads``).
Each repetition runs ``--steps`` timed steps of each contender after 3 warm-up steps, the
contenders taking turns (compute only, commlib, torch DDP over gloo, torch DDP over the
commlib backend: ``new_group(backend="commlib")``), each step after a barrier.
For commlib, the step is split by wall-clock stamps on the main thread (forward, backward
including the wait for the last bucket, optimizer step) and on the communication thread
(each bucket's exchange from its launch to its completion, which includes waiting for the
slower peer), and every copy of a gradient into its bucket (``_bind``; none where the
exchange gathers them itself, ``Algorithm.fuses_bucket_copy``) is timed. Medians over
steps per rank, then the slowest rank; the job's figures go to ``--json``.

It wraps commlib internals (``commlib.ddp.hooks``) by name: a diagnostic for developers.
The wrapping itself costs a few microseconds per bucket.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


class Stamps:
    """Per-step sums of named intervals (seconds), collected while ``on`` is set."""

    def __init__(self) -> None:
        self.on = False
        self.step: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def add(self, name: str, seconds: float) -> None:
        if self.on:
            self.step[name] = self.step.get(name, 0.0) + seconds

    def close(self) -> None:
        if self.on:
            self.steps.append(self.step)
        self.step = {}


def instrument(stamps: Stamps) -> None:
    """Time every ``_bind`` copy and every bucket exchange (to completion)."""
    from commlib.ddp import hooks
    from commlib.ddp.engine import drive
    bind, exchange = hooks._bind, hooks.GradientHooks._exchange

    def timed_bind(p: Any, view: Any) -> None:
        t0 = time.perf_counter()
        bind(p, view)
        stamps.add("bucket copies", time.perf_counter() - t0)

    def timed_exchange(self: Any, bucket: Any, events: Any) -> None:
        t0 = time.perf_counter()
        drive(exchange(self, bucket, events))
        stamps.add(f"exchange bucket {bucket.index} ({bucket.nbytes / 2**20:.1f} MiB)",
                   time.perf_counter() - t0)

    hooks._bind = timed_bind
    hooks.GradientHooks._exchange = timed_exchange


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="1024,4096,4096,1024,10")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-torch", action="store_true", help="leave torch DDP out")
    p.add_argument("--no-backend", action="store_true",
                   help="leave torch DDP over the commlib backend out")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import torch
    import torch.nn.functional as F
    torch.set_num_threads(args.threads)
    import bench_ddp
    import commlib

    rank, n = commlib.get_rank(), commlib.get_world_size()
    sizes = [int(v) for v in args.layers.split(",")]
    model_args = argparse.Namespace(layers=args.layers, width=0, depth=0)
    torch.manual_seed(1 + rank)
    x = torch.randn(args.batch, sizes[0])
    y = torch.randint(0, sizes[-1], (args.batch,))

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)

    stamps = Stamps()
    instrument(stamps)
    local = bench_ddp.make_model(model_args)
    local_opt = sgd(local.parameters())
    ours = commlib.DistributedDataParallel(bench_ddp.make_model(model_args),
                                           bucket_cap_mb=args.bucket_cap_mb)
    ours_opt = sgd(ours.parameters())
    buckets = [b.nbytes for b in ours._ctx.buckets]

    def commlib_step() -> None:
        t0 = time.perf_counter()
        ours_opt.zero_grad()
        loss = F.cross_entropy(ours(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        ours_opt.step()
        t3 = time.perf_counter()
        stamps.add("forward", t1 - t0)
        stamps.add("backward (to the last bucket's completion)", t2 - t1)
        stamps.add("optimizer step", t3 - t2)
        stamps.close()

    steps = {"compute only": bench_ddp.training_step(local, local_opt, x, y),
             "commlib": commlib_step}
    if not args.no_torch:
        bench_ddp.init_gloo()
        theirs = torch.nn.parallel.DistributedDataParallel(
            bench_ddp.make_model(model_args), bucket_cap_mb=args.bucket_cap_mb)
        steps["torch DDP (gloo)"] = bench_ddp.training_step(theirs, sgd(theirs.parameters()),
                                                            x, y)
        if not args.no_backend:
            import torch.distributed as dist

            import commlib.torch_backend  # noqa: F401 - registers backend "commlib"
            group = dist.new_group(backend="commlib")
            backend = torch.nn.parallel.DistributedDataParallel(
                bench_ddp.make_model(model_args), bucket_cap_mb=args.bucket_cap_mb,
                process_group=group)
            steps["torch DDP (commlib backend)"] = bench_ddp.training_step(
                backend, sgd(backend.parameters()), x, y)
    per_rep: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.reps):
        for name, step in steps.items():
            for _ in range(3):
                step()
            times = []
            stamps.on = name == "commlib"
            for _ in range(args.steps):
                commlib.barrier()
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            stamps.on = False
            per_rep[name].append(statistics.median(times))
    ours.close()

    step_ms = {k: 1e3 * float(commlib.allreduce(np.array([statistics.median(v)]),
                                                op="max")[0]) for k, v in per_rep.items()}
    parts = sorted({k for s in stamps.steps for k in s})
    part_ms = {k: 1e3 * float(commlib.allreduce(
        np.array([statistics.median([s.get(k, 0.0) for s in stamps.steps])]), op="max")[0])
        for k in parts}
    if rank != 0:
        return
    torch_ms = step_ms.get("torch DDP (gloo)")
    rows = [[k, C.fmt(v, 1), C.fmt(v / torch_ms, 3) if torch_ms else "-"]
            for k, v in step_ms.items()]
    print(f"{n} ranks, MLP {args.layers}, batch {args.batch}, buckets "
          f"{[round(b / 2**20, 1) for b in buckets]} MiB; medians of {args.reps} reps of "
          f"{args.steps} steps, slowest rank")
    print(C.format_table(["step", "ms", "x torch DDP"], rows))
    print(C.format_table(["commlib step, part", "ms (median per step, slowest rank)"],
                         [[k, C.fmt(v, 2)] for k, v in part_ms.items()]))
    if args.json:
        C.write_json(args.json, {"environment": C.environment(n), "args": vars(args),
                                 "buckets_bytes": buckets, "step_ms": step_ms,
                                 "per_rep_rank0_s": per_rep, "commlib_parts_ms": part_ms})


if __name__ == "__main__":
    main()
