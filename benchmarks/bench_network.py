"""Step time and bytes per step of every algorithm under network bandwidth limits: the
trade-off exploration of the Bagua paper, on our machine, with torch DDP over gloo as the
peer.

    python benchmarks/bench_network.py --ranks 4 --rates 100,1000,10000,0 \\
        --json benchmarks/results/network.json --plot benchmarks/results/network.png

Each rate runs one ``mpiexec`` job inside a network namespace whose loopback is limited to
that many Mbit/s (0 = no limit; see ``netsim``): all ranks share that one link. MPICH is
forced onto TCP so its traffic crosses the limited link; gloo uses TCP anyway. The model is
communication-bound (a wide MLP, small batch). Step time: median over timed steps of the
slowest rank's step, and the mean (total / steps, slowest rank): for periodic algorithms
(local_sgd) the median is a non-communicating step, the mean counts every step. Bytes per
step: what rank 0 handed to MPI (``commlib.stats()``), divided by the timed steps.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402

# name -> (algorithm, algorithm kwargs, optimizer); qadam's warm-up ends before timing.
CONTENDERS: dict[str, tuple[str, dict[str, Any], str]] = {
    "gradient_allreduce": ("gradient_allreduce", {}, "sgd"),
    "bytegrad": ("bytegrad", {}, "sgd"),
    "qadam": ("qadam", {"warmup_steps": 1}, "qadam"),
    "decentralized": ("decentralized", {"peer_selection_mode": "shift_one"}, "sgd"),
    "low_precision_decentralized": ("low_precision_decentralized", {}, "sgd"),
    "local_sgd": ("local_sgd", {"sync_every": 4}, "sgd"),
    "async_model_average": ("async_model_average", {"sync_interval_ms": 100}, "sgd"),
}


# -- worker: runs under mpiexec inside the namespace ---------------------------------------

def _optimizer(kind: str, params: Any) -> Any:
    import torch
    if kind == "qadam":
        from commlib.algorithms.qadam import QAdamOptimizer
        return QAdamOptimizer(params, lr=1e-3)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def _measure(make: Callable[[], tuple[Any, Any, Callable[[], None]]],
             args: argparse.Namespace, counted: bool = True) -> dict[str, float | None]:
    """Median and mean (total / steps) step time of the slowest rank, and the bytes this
    rank handed to MPI per step (``None`` for a peer whose traffic commlib does not see).
    The mean counts the communicating steps of periodic algorithms (local_sgd), which the
    median hides."""
    import numpy as np

    import commlib
    model, closer, step = make()
    commlib.barrier()
    commlib.stats(reset=True)
    times = C.step_times(step, args.warmup, args.steps)
    counters = commlib.stats(reset=True)
    closer()
    slowest, slowest_mean = commlib.allreduce(
        np.array([statistics.median(times), sum(times) / len(times)]), op="max")
    total = args.warmup + args.steps

    def per_step(field: str) -> float | None:
        return sum(v[field] for v in counters.values()) / total if counted else None
    return {"step_s": float(slowest), "mean_step_s": float(slowest_mean),
            "bytes_per_step": per_step("bytes"),
            "bus_bytes_per_step": per_step("bus_bytes")}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    import commlib
    from bench_ddp import init_gloo
    from models import WideMLP

    commlib.init()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(commlib.get_rank())
    x, y = torch.randn(args.batch, 784, generator=g), torch.randint(0, 10, (args.batch,), generator=g)

    def step_of(model: Any, opt: Any) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return step

    def ours(algorithm: str, kwargs: dict, opt: str) -> Callable:
        def make() -> tuple:
            torch.manual_seed(0)
            ddp = commlib.DistributedDataParallel(WideMLP(width=args.width, depth=args.depth),
                                                  algorithm=algorithm, **kwargs)
            return ddp, ddp.close, step_of(ddp, _optimizer(opt, ddp.parameters()))
        return make

    def theirs() -> tuple:
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(WideMLP(width=args.width,
                                                                depth=args.depth))
        return ddp, lambda: None, step_of(ddp, _optimizer("sgd", ddp.parameters()))

    results = {}
    for name in args.algorithms.split(","):
        algorithm, kwargs, opt = CONTENDERS[name]
        results[name] = _measure(ours(algorithm, kwargs, opt), args)
    init_gloo()
    results["torch_ddp_gloo"] = _measure(theirs, args, counted=False)
    if commlib.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump(results, fh)


# -- driver: one mpiexec job per rate ------------------------------------------------------

def drive(args: argparse.Namespace) -> dict[str, Any]:
    from netsim import can_shape, run_limited
    shaped, why = can_shape()
    out: dict[str, Any] = {"ranks": args.ranks, "shaped": shaped, "why": why,
                           "link": "one link shared by all ranks (namespace loopback)",
                           "rates_mbit": {}}
    for rate in [float(r) for r in args.rates.split(",")]:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
            path = fh.name
        cmd = [shutil.which("mpiexec") or "mpiexec", "-n", str(args.ranks), sys.executable,
               os.path.abspath(__file__), "--worker", "--out", path] + _passthrough(args)
        label = "unlimited" if rate == 0 else f"{rate:g}"
        print(f"rate {label} Mbit/s ...", flush=True)
        code = run_limited(rate or None, cmd, timeout=args.timeout)
        if code != 0:
            raise SystemExit(f"worker at {label} Mbit/s exited {code}")
        with open(path) as fh:
            out["rates_mbit"][label] = json.load(fh)
        os.unlink(path)
    return out


def _passthrough(args: argparse.Namespace) -> list[str]:
    return ["--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch),
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--algorithms", args.algorithms]


def report(result: dict[str, Any]) -> None:
    print(f"\n{result['ranks']} ranks; {result['link']}; shaping: {result['why']}")
    for label, rows in result["rates_mbit"].items():
        base = rows["gradient_allreduce"]["step_s"]
        base_mean = rows["gradient_allreduce"].get("mean_step_s") or base
        print(f"\n{label} Mbit/s        median ms  x grad_ar   mean ms  x grad_ar   bus MB/step")
        for name, r in rows.items():
            bus = r["bus_bytes_per_step"]
            mean = r.get("mean_step_s") or float("nan")
            shown = "   (gloo: not counted)" if bus is None else f"   {bus / 1e6:10.2f}"
            print(f"  {name:<28} {r['step_s'] * 1e3:9.1f}  {r['step_s'] / base:8.3f}  "
                  f"{mean * 1e3:8.1f}  {mean / base_mean:8.3f}{shown}")
    target = result["rates_mbit"].get("1000")
    if target:
        g = target["gradient_allreduce"]["step_s"]
        gm = target["gradient_allreduce"].get("mean_step_s") or g
        for name, limit in (("bytegrad", 0.4), ("qadam", 0.25)):
            if name in target:
                ratio = target[name]["step_s"] / g
                mean = (target[name].get("mean_step_s") or float("nan")) / gm
                print(f"1 Gbit/s: {name} / gradient_allreduce = {ratio:.3f} median, "
                      f"{mean:.3f} mean (target <= {limit}: "
                      f"{'PASS' if max(ratio, mean) <= limit else 'MISS'})")
        ratio = g / target["torch_ddp_gloo"]["step_s"]
        print(f"1 Gbit/s: gradient_allreduce / torch DDP = {ratio:.3f} (target <= 1: "
              f"{'PASS' if ratio <= 1 else 'MISS'})")


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = list(result["rates_mbit"])
    names = list(next(iter(result["rates_mbit"].values())))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in names:
        axes[0].plot(labels, [result["rates_mbit"][r][name]["step_s"] for r in labels],
                     marker="o", label=name)
        if result["rates_mbit"][labels[0]][name]["bus_bytes_per_step"] is not None:
            axes[1].plot(labels, [result["rates_mbit"][r][name]["bus_bytes_per_step"] / 1e6
                                  for r in labels], marker="o", label=name)
    axes[0].set(yscale="log", xlabel="link rate (Mbit/s)", ylabel="step time (s)",
                title=f"step time, {result['ranks']} ranks, one shared link")
    axes[1].set(yscale="log", xlabel="link rate (Mbit/s)", ylabel="bus MB per step (rank 0)",
                title="bytes per step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rates", default="100,1000,10000,0", help="Mbit/s, comma-separated; 0: none")
    p.add_argument("--algorithms", default=",".join(CONTENDERS))
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="per rank")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    result = drive(args)
    report(result)
    if args.json:
        C.write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
