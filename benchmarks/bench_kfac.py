"""dp_kfac against d_kfac: cost of a second-order update on ResNet-18 layer shapes and on the
example CNN, plus loss curves of dp_kfac, d_kfac and SGD on the example problem.

    timeout 1500 mpiexec -n 4 python benchmarks/bench_kfac.py

Both algorithms run in the same job, one after the other on the same model and data, with a
second-order update every step (``factor_update_steps = inv_update_steps = 1``). Per rank and
per step: the wall time of the step and of its second-order work (factors, inverses,
preconditioning, second-order communication), the CPU time of building factors, and the bytes
handed to MPI (``commlib.stats()``); each is a median over ``--steps`` steps after
``--warmup`` steps (the step time also as a mean, total / steps). Second-order memory is ``second_order_bytes()`` after the last step.
Across ranks: the maximum (the job waits for its slowest rank; the largest memory) and the
mean (the average rank). Ratios are d_kfac / dp_kfac, so > 1 means dp_kfac needs less.

ResNet-18 is written out here (torchvision is not needed): its real convolution and linear
shapes (1000 classes) on small ``--image`` inputs. Factor CPU time is measured with
``time.thread_time`` and one torch thread per rank (``--threads``), so ranks sharing cores
do not inflate each other's numbers. Results: JSON and a loss-curve plot under
``benchmarks/results/``, and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import commlib  # noqa: E402
from models import SmallCNN  # noqa: E402  (the example CNN of the tests)

ALGORITHMS = ("dp_kfac", "d_kfac")
RESULTS = os.path.join(HERE, "results")


# -- models -------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convolutions, a 1x1 projection when the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                            nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """torchvision's ResNet-18 layer for layer: 20 convolutions and a 512 x 1000 linear."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        blocks, c_in = [], 64
        for i, c_out in enumerate((64, 128, 256, 512)):
            stride = 1 if i == 0 else 2
            blocks += [BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out, 1)]
            c_in = c_out
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(x), 1), 1))


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits (bundled, no download) as float32 images in [0, 1]."""
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8), torch.tensor(y)


Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def workload(name: str, args: argparse.Namespace) -> tuple[Callable[[], nn.Module], Batch]:
    """(model factory, batch of this rank at a step) of a benchmark model."""
    rank, n = commlib.get_rank(), commlib.get_world_size()
    if name == "resnet18":
        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(step * 1000 + rank)
            x = torch.randn(args.batch, 3, args.image, args.image, generator=g)
            return x, torch.randint(0, 1000, (args.batch,), generator=g)
        return ResNet18, batch
    x_all, y_all = digits()

    def digits_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, len(x_all), (n * args.cnn_batch,), generator=g)
        mine = idx[rank * args.cnn_batch:(rank + 1) * args.cnn_batch]
        return x_all[mine], y_all[mine]
    return SmallCNN, digits_batch


# -- measurement --------------------------------------------------------------------------
def measure(name: str, algorithm: str, steps: int, args: argparse.Namespace) -> dict[str, Any]:
    """Medians over ``steps`` measured steps of this rank's metrics (see the module doc)."""
    factory, batch = workload(name, args)
    torch.manual_seed(0)
    kw = {} if algorithm == "gradient_allreduce" else dict(
        factor_update_steps=1, inv_update_steps=1, inverse=args.inverse,
        assignment=args.assignment, damping=args.damping, lr=args.lr)
    ddp = commlib.DistributedDataParallel(factory(), algorithm=algorithm, **kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    per_step: dict[str, list[float]] = {}
    try:
        for step in range(args.warmup + steps):
            sample = _one_step(ddp, opt, *batch(step))
            if step >= args.warmup:
                for key, value in sample.items():
                    per_step.setdefault(key, []).append(value)
        out = {k: statistics.median(v) for k, v in per_step.items()}
        out["step_mean_s"] = sum(per_step["step_s"]) / len(per_step["step_s"])
        if algorithm != "gradient_allreduce":
            out["memory"] = ddp.algorithm.memory_breakdown()
            out["owned_layers"] = sum(r == commlib.get_rank()
                                      for r in ddp.algorithm.owners().values())
            out["layers"] = len(ddp.algorithm.owners())
        return out
    finally:
        ddp.close()


def _one_step(ddp: Any, opt: torch.optim.Optimizer, x: torch.Tensor,
              y: torch.Tensor) -> dict[str, float]:
    commlib.barrier()  # every rank starts the step together
    commlib.stats(reset=True)
    algo = ddp.algorithm
    if hasattr(algo, "timings"):
        algo.timings(reset=True)
    start = time.perf_counter()
    opt.zero_grad()
    F.cross_entropy(ddp(x), y).backward()
    opt.step()
    sample = {"step_s": time.perf_counter() - start}
    counters = commlib.stats(reset=True)
    sample["bytes"] = float(sum(v["bytes"] for v in counters.values()))
    sample["bus_bytes"] = float(sum(v["bus_bytes"] for v in counters.values()))
    if hasattr(algo, "timings"):
        t = algo.timings()
        sample["second_order_s"] = sum(p["wall_s"] for p in t.values())
        sample["factors_cpu_s"] = t["factors"]["cpu_s"]
        sample["inverses_cpu_s"] = t["inverses"]["cpu_s"]
        sample["precondition_cpu_s"] = t["precondition"]["cpu_s"]
        sample["communication_s"] = t["communication"]["wall_s"]
    return sample


def across_ranks(local: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{metric: {"max", "mean", "per_rank"}} of the scalar metrics of every rank; the memory
    breakdown becomes ``memory.<part>`` and ``memory.total``."""
    flat = {k: float(v) for k, v in local.items() if isinstance(v, (int, float))}
    memory = local.get("memory", {})
    flat.update({f"memory.{k}": float(v) for k, v in memory.items()})
    if memory:
        flat["memory.total"] = float(sum(memory.values()))
    keys = sorted(flat)  # the same keys, in the same order, on every rank
    table = commlib.allgather(np.array([flat[k] for k in keys], dtype=np.float64))
    return {k: {"max": float(table[:, i].max()), "mean": float(table[:, i].mean()),
                "per_rank": table[:, i].tolist()} for i, k in enumerate(keys)}


# -- loss curves --------------------------------------------------------------------------
def loss_curve(algorithm: str, args: argparse.Namespace) -> list[float]:
    """Global mean training loss per step of the example CNN on the digits."""
    _, batch = workload("cnn", args)
    torch.manual_seed(0)
    kw = {} if algorithm == "sgd" else dict(damping=args.curve_damping, lr=args.curve_lr)
    ddp = commlib.DistributedDataParallel(SmallCNN(), algorithm="gradient_allreduce"
                                          if algorithm == "sgd" else algorithm, **kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.curve_lr, momentum=0.9)
    losses = []
    try:
        for step in range(args.curve_steps):
            x, y = batch(step)
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return (commlib.allreduce(np.array(losses), op=commlib.ReduceOp.AVG)).tolist()
    finally:
        ddp.close()


def plot(curves: dict[str, list[float]], path: str, world: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    window = 10
    for name, losses in curves.items():
        line, = ax.plot(range(1, len(losses) + 1), losses, alpha=0.3, linewidth=0.8)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax.plot(range(window, len(losses) + 1), smooth, color=line.get_color(),
                label=f"{name} ({window}-step mean)")
    ax.set(xlabel="step", ylabel="training loss (mean over ranks)", yscale="log",
           title=f"SmallCNN on 8x8 digits, {world} ranks, same learning rate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- report -------------------------------------------------------------------------------
ROWS = [  # (label, metric, statistic, scale, unit)
    ("second-order update time (slowest rank)", "second_order_s", "max", 1e3, "ms"),
    ("factor computation CPU per rank (mean)", "factors_cpu_s", "mean", 1e3, "ms"),
    ("factor computation CPU (busiest rank)", "factors_cpu_s", "max", 1e3, "ms"),
    ("inversion CPU (busiest rank)", "inverses_cpu_s", "max", 1e3, "ms"),
    ("preconditioning CPU per rank (mean)", "precondition_cpu_s", "mean", 1e3, "ms"),
    ("step time, median (slowest rank)", "step_s", "max", 1e3, "ms"),
    ("step time, mean = total / steps (slowest rank)", "step_mean_s", "max", 1e3, "ms"),
    ("bytes to MPI per step per rank (mean)", "bytes", "mean", 2 ** -20, "MiB"),
    ("bus bytes per step per rank (mean)", "bus_bytes", "mean", 2 ** -20, "MiB"),
    ("2nd-order bytes per step per rank (mean)", "so_bytes", "mean", 2 ** -20, "MiB"),
    ("second-order memory per rank (max)", "memory.total", "max", 2 ** -20, "MiB"),
    ("second-order memory per rank (mean)", "memory.total", "mean", 2 ** -20, "MiB"),
    ("  factors + inverses (max)", "memory.held", "max", 2 ** -20, "MiB"),
]


def add_derived(result: dict[str, Any]) -> None:
    """Second-order bytes = bytes minus SGD's (the gradient allreduce); memory.held =
    factors + inverses (what persists between steps)."""
    sgd = result["gradient_allreduce"]["bytes"]["mean"]
    for algo in ALGORITHMS:
        r = result[algo]
        r["so_bytes"] = {"mean": r["bytes"]["mean"] - sgd}
        held = [a + b for a, b in zip(r["memory.factors"]["per_rank"],
                                      r["memory.inverses"]["per_rank"])]
        r["memory.held"] = {"max": max(held), "mean": sum(held) / len(held), "per_rank": held}


def table(name: str, result: dict[str, Any]) -> str:
    lines = [f"\n== {name}: {result['dp_kfac']['layers']['max']:.0f} K-FAC layers, "
             f"{commlib.get_world_size()} ranks",
             f"{'metric':44s}{'d_kfac':>12s}{'dp_kfac':>12s}{'d/dp':>8s}  unit"]
    for label, key, stat, scale, unit in ROWS:
        d, dp = result["d_kfac"][key][stat], result["dp_kfac"][key][stat]
        ratio = f"{d / dp:8.2f}" if dp else "     inf"
        lines.append(f"{label:44s}{d * scale:12.3f}{dp * scale:12.3f}{ratio}  {unit}")
    return "\n".join(lines)


def ratios(result: dict[str, Any]) -> dict[str, float]:
    return {f"{label} [{stat}]": result["d_kfac"][key][stat] / result["dp_kfac"][key][stat]
            for label, key, stat, _, _ in ROWS if result["dp_kfac"][key][stat]}


# -- main ---------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["resnet18", "cnn"],
                   choices=["resnet18", "cnn"])
    p.add_argument("--steps", type=int, default=5, help="measured ResNet-18 steps")
    p.add_argument("--cnn-steps", type=int, default=30, help="measured example-CNN steps")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured first steps")
    p.add_argument("--batch", type=int, default=8, help="ResNet-18 examples per rank")
    p.add_argument("--image", type=int, default=32, help="ResNet-18 input side")
    p.add_argument("--cnn-batch", type=int, default=32, help="example-CNN examples per rank")
    p.add_argument("--inverse", default="eigen", choices=["eigen", "cholesky"])
    p.add_argument("--assignment", default="greedy", choices=["greedy", "round_robin"])
    p.add_argument("--damping", type=float, default=1e-3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--curve-steps", type=int, default=100, help="0: no loss curves")
    p.add_argument("--curve-lr", type=float, default=0.05)
    p.add_argument("--curve-damping", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default=None, help="default: results/kfac_n<ranks>.json")
    p.add_argument("--plot", default=None, help="default: results/kfac_loss_n<ranks>.png")
    return p.parse_args()


def log(message: str) -> None:
    if commlib.get_rank() == 0:
        print(message, flush=True)


#: the paper's lower bounds (DP-KFAC against D-KFAC, 64 GPUs): (label, metric, statistic)
TARGETS = [("communication >= 2.79x", 2.79, "bus_bytes", "mean"),
           ("memory >= 1.14x", 1.14, "memory.total", "max"),
           ("factor computation >= 1.55x", 1.55, "factors_cpu_s", "max")]


def benchmark_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """SGD, dp_kfac and d_kfac on one model; prints the table and the targets."""
    steps = args.steps if name == "resnet18" else args.cnn_steps
    result = {}
    for algo in ("gradient_allreduce",) + ALGORITHMS:
        start = time.perf_counter()
        result[algo] = across_ranks(measure(name, algo, steps, args))
        log(f"{name} {algo}: {time.perf_counter() - start:.0f} s")
    add_derived(result)
    log(table(name, result))
    log("layers owned per rank: " + str([int(v) for v in
                                          result["dp_kfac"]["owned_layers"]["per_rank"]]))
    for label, bound, key, stat in TARGETS:
        ratio = result["d_kfac"][key][stat] / result["dp_kfac"][key][stat]
        log(f"target {label:30s} [{stat} over ranks]: {ratio:6.2f}x "
            f"{'met' if ratio >= bound else 'NOT met'}")
    return {"metrics": result, "ratios_d_over_dp": ratios(result)}


def write(report: dict[str, Any], args: argparse.Namespace) -> None:
    """JSON (and the loss-curve plot when there are curves), on rank 0."""
    n = report["world_size"]
    os.makedirs(RESULTS, exist_ok=True)
    path = args.json or os.path.join(RESULTS, f"kfac_n{n}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {path}")
    if report["loss_curves"]:
        plot_path = args.plot or os.path.join(RESULTS, f"kfac_loss_n{n}.png")
        plot(report["loss_curves"], plot_path, n)
        print(f"wrote {plot_path}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"config": vars(args), "world_size": commlib.get_world_size(),
                              "models": {}, "loss_curves": {}}
    for name in args.models:
        report["models"][name] = benchmark_model(name, args)
    if args.curve_steps > 0:
        curves = {algo: loss_curve(algo, args) for algo in ("sgd",) + ALGORITHMS}
        report["loss_curves"] = curves
        log(f"\nloss after {args.curve_steps} steps (mean of the last 10): " +
            ", ".join(f"{k} {np.mean(v[-10:]):.3f}" for k, v in curves.items()))
    if commlib.get_rank() == 0:
        write(report, args)


if __name__ == "__main__":
    main()
