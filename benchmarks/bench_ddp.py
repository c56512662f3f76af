"""Data-parallel training step: commlib.DistributedDataParallel against torch DDP over gloo
(and Horovod where installed), measured in the same mpiexec job, plus the compute-only
floor; and bucketed allreduce of ResNet-18-shaped gradients against one allreduce per
tensor and one flat raw mpi4py allreduce.

    mpiexec -n 2 python benchmarks/bench_ddp.py --json results/ddp-2.json --plot results/ddp-2.png

Every figure is a median over repetitions; peers run interleaved with commlib (rep after
rep) so machine noise hits all alike. Step times are per rank, then the maximum over ranks
(the job moves at the pace of its slowest rank).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import commlib  # noqa: E402
from commlib.algorithms.buckets import build  # noqa: E402
from models import WideMLP, resnet18_shapes  # noqa: E402


def slowest(seconds: float) -> float:
    """Maximum over ranks of a per-rank time."""
    return float(commlib.allreduce(np.array([seconds]), op="max")[0])


MEANS: dict[str, list[float]] = {}   # name -> per repetition, mean step (total / steps)


def time_steps(step: Callable[[], None], steps: int, warmup: int, name: str = "") -> float:
    """Median seconds of ``step`` per rank after ``warmup`` calls, ranks aligned first; the
    slowest rank's. The slowest rank's mean (total / steps) is appended to
    ``MEANS[name]``."""
    C.step_times(step, warmup, 0)
    commlib.barrier()
    times = C.step_times(step, 0, steps)
    median, mean = commlib.allreduce(np.array([statistics.median(times),
                                               sum(times) / len(times)]), op="max")
    MEANS.setdefault(name, []).append(float(mean))
    return float(median)


def training_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                  y: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def sequential_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                    y: torch.Tensor) -> Callable[[], None]:
    """Backward first, then one allreduce of all gradients: what DDP costs without overlap."""
    from commlib.base.reduce_ops import ReduceOp

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        commlib.allreduce(flat, op=ReduceOp.AVG)
        offset = 0
        for p in model.parameters():
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
    return step


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    if args.layers:
        sizes = [int(v) for v in args.layers.split(",")]
        layers: list[torch.nn.Module] = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers[:-1])
    return WideMLP(width=args.width, depth=args.depth)


def input_width(args: argparse.Namespace) -> int:
    return int(args.layers.split(",")[0]) if args.layers else 784


def classes(args: argparse.Namespace) -> int:
    return int(args.layers.split(",")[-1]) if args.layers else 10


def init_gloo() -> Any:
    import torch.distributed as dist
    port = np.array([0])
    if commlib.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    commlib.broadcast(port, src=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port[0])}",
                            rank=commlib.get_rank(), world_size=commlib.get_world_size())
    return dist


def horovod() -> Any:
    try:
        import horovod.torch as hvd
    except ImportError:
        return None
    hvd.init()
    return hvd


def contenders(args: argparse.Namespace, x: torch.Tensor,
               y: torch.Tensor) -> dict[str, Callable[[], None]]:
    """name -> one training step. Each contender owns its model and optimizer."""
    out: dict[str, Callable[[], None]] = {}

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)

    local = make_model(args)
    out["compute_only"] = training_step(local, sgd(local.parameters()), x, y)
    serial = make_model(args)
    out["no_overlap"] = sequential_step(serial, sgd(serial.parameters()), x, y)
    ours = commlib.DistributedDataParallel(make_model(args), bucket_cap_mb=args.bucket_cap_mb)
    out["commlib"] = training_step(ours, sgd(ours.parameters()), x, y)
    if "torch" in args.peers:
        init_gloo()
        theirs = torch.nn.parallel.DistributedDataParallel(make_model(args),
                                                           bucket_cap_mb=args.bucket_cap_mb)
        out["torch_ddp_gloo"] = training_step(theirs, sgd(theirs.parameters()), x, y)
    hvd = horovod() if "horovod" in args.peers else None
    if hvd is not None:
        model = make_model(args)
        opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                       named_parameters=model.named_parameters())
        out["horovod"] = training_step(model, opt, x, y)
    elif "horovod" in args.peers and commlib.get_rank() == 0:
        print("horovod: not installed, peer skipped (../shared/peers/install-horovod.sh "
              "builds it)", flush=True)
    return out


def bench_steps(args: argparse.Namespace) -> dict[str, Any]:
    g = torch.Generator().manual_seed(commlib.get_rank())
    x = torch.randn(args.batch, input_width(args), generator=g)
    y = torch.randint(0, classes(args), (args.batch,), generator=g)
    steps = contenders(args, x, y)
    grads = torch.zeros(sum(p.numel() for p in make_model(args).parameters()))
    steps["allreduce_alone"] = lambda: commlib.allreduce(grads)
    results: dict[str, list[float]] = {name: [] for name in steps}
    results["compute_alone"] = []
    alone = steps["compute_only"]
    for _ in range(args.reps):
        for name, step in steps.items():
            results[name].append(time_steps(step, args.steps, args.warmup, name))
        results["compute_alone"].append(_alone(alone, args))
    commlib.stats(reset=True)
    steps["commlib"]()
    bytes_per_step = commlib.stats(reset=True)
    return {"median_s": {k: statistics.median(v) for k, v in results.items()},
            "mean_s": {k: statistics.median(MEANS[k]) for k in results if k in MEANS},
            "all_s": results, "commlib_bytes_per_step": bytes_per_step}


def _alone(step: Callable[[], None], args: argparse.Namespace) -> float:
    """Rank 0 computes while the other ranks wait idle: the one-rank compute floor."""
    seconds = 0.0
    if commlib.get_rank() == 0:
        seconds = statistics.median(C.step_times(step, args.warmup, args.steps))
    return float(commlib.broadcast(np.array([seconds]), src=0)[0])


def bench_buckets(args: argparse.Namespace) -> dict[str, Any]:
    """ResNet-18 gradients: bucketed commlib allreduce vs one per tensor vs raw mpi4py."""
    from mpi4py import MPI
    grads = [(name, torch.randn(shape)) for name, shape in resnet18_shapes()]
    buckets = build(grads, int(args.bucket_cap_mb * (1 << 20)))
    flat = np.concatenate([g.numpy().ravel() for _, g in grads])
    raw = MPI.COMM_WORLD.Dup()

    def bucketed() -> None:
        works = [commlib.allreduce(b.flat, async_op=True) for b in buckets]
        for w in works:
            w.wait()

    def per_tensor() -> None:
        for _, g in grads:
            commlib.allreduce(g)

    def raw_flat() -> None:
        raw.Allreduce(MPI.IN_PLACE, flat)

    cases = {"commlib_bucketed": bucketed, "commlib_per_tensor": per_tensor,
             "mpi4py_flat": raw_flat}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.reps):
        for name, fn in cases.items():
            times[name].append(time_steps(fn, max(2, args.steps // 2), 1, name))
    raw.Free()
    return {"tensors": len(grads), "bytes": int(flat.nbytes), "buckets": len(buckets),
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "mean_s": {k: statistics.median(MEANS[k]) for k in times}}


def report(steps: dict[str, Any], buckets: dict[str, Any] | None, n: int) -> None:
    t = steps["median_s"]
    means = steps.get("mean_s", {})
    print(f"\ntraining step, {n} ranks (median and mean (total / steps) seconds, slowest "
          f"rank; median over repetitions):")
    for name, seconds in t.items():  # allreduce_alone: one flat allreduce of all gradients
        mean = means.get(name)
        shown = f"   mean {mean * 1e3:9.2f} ms" if mean is not None else ""
        print(f"  {name:<16} {seconds * 1e3:9.2f} ms   {seconds / t['commlib']:6.3f}x commlib"
              f"{shown}")
    if "torch_ddp_gloo" in t:
        ratio = t["commlib"] / t["torch_ddp_gloo"]
        print(f"  commlib / torch DDP (gloo)     = {ratio:.3f}  (target <= 0.90: "
              f"{'PASS' if ratio <= 0.9 else 'MISS'})")
    ratio = t["commlib"] / t["no_overlap"]
    print(f"  commlib / no_overlap (backward, then allreduce) = {ratio:.3f}  "
          f"(< 1: communication overlapped with backward)")
    for floor in ("compute_only", "compute_alone"):
        ratio = t["commlib"] / t[floor]
        print(f"  commlib / {floor:<19}  = {ratio:.3f}  (target <= 1.15: "
              f"{'PASS' if ratio <= 1.15 else 'MISS'})")
    bound = t["compute_only"] + t["allreduce_alone"]
    print(f"  commlib / (compute_only + allreduce_alone) = {t['commlib'] / bound:.3f}  (the "
          f"bound when no core is free: the\n    exchange's own CPU time, "
          f"{t['allreduce_alone'] * 1e3:.1f} ms, cannot hide behind compute)")
    if buckets is None:
        return
    b = buckets["median_s"]
    print(f"\nResNet-18 gradients ({buckets['tensors']} tensors, {buckets['bytes'] / 2**20:.1f} "
          f"MiB, {buckets['buckets']} buckets), {n} ranks:")
    for name, seconds in b.items():
        print(f"  {name:<20} {seconds * 1e3:9.2f} ms   "
              f"{seconds / b['mpi4py_flat']:6.3f}x raw flat mpi4py")


def plot(steps: dict[str, Any], buckets: dict[str, Any] | None, n: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(steps["median_s"], f"training step, {n} ranks")]
    if buckets is not None:
        panels.append((buckets["median_s"], f"ResNet-18 gradients, {n} ranks"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (data, title) in zip(axes[0], panels):
        names = list(data)
        ax.bar(names, [data[k] * 1e3 for k in names], color="tab:blue")
        ax.set_ylabel("ms (median, slowest rank)")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--depth", type=int, default=4, help="hidden layers of the MLP")
    p.add_argument("--layers", default=None,
                   help="an MLP of these widths instead, e.g. 1024,4096,4096,1024,10 (issue "
                        "33's model: 25 M parameters, 100 MB of float32 gradients)")
    p.add_argument("--no-buckets", action="store_true",
                   help="skip the ResNet-18 bucketed-allreduce part")
    p.add_argument("--batch", type=int, default=64, help="per-rank batch")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--peers", default="torch,horovod",
                   help="comma-separated peers among torch,horovod")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank (0: cores / ranks on the node)")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    commlib.init()
    n = commlib.get_world_size()
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // commlib.get_local_size()))
    steps = bench_steps(args)
    buckets = None if args.no_buckets else bench_buckets(args)
    if commlib.get_rank() == 0:
        report(steps, buckets, n)
        result = {"ranks": n, "args": vars(args), "steps": steps, "buckets": buckets,
                  "threads_per_rank": torch.get_num_threads()}
        if args.json:
            C.write_json(args.json, result)
        if args.plot:
            plot(steps, buckets, n, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
