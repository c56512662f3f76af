"""Hierarchical vs flat exchange on an emulated two-tier cluster (issue 13, part 4).

    flock /tmp/commlib-bench.lock python benchmarks/bench_hierarchical.py \\
        --shapes 2x2,4x1 --rates 100,1000,10000 \\
        --json benchmarks/results/hierarchical.json --plot benchmarks/results/hierarchical.png

For every shape (``NODESxRANKS_PER_NODE``) and inter-node rate (Mbit/s per node link, each
direction) a cluster of network namespaces is built with ``netsim.two_tier`` (ranks of a
node share memory; nodes talk TCP through shaped veths), its point-to-point bandwidth and
round trip between node 0 and node 1 are measured, then one ``mpiexec`` job times:

* (a) a raw ``commlib.allreduce`` (float32, SUM) of each size, flat and with
  ``hierarchical=True`` (``--scheme`` picks the hierarchical scheme when several exist):
  median over repetitions of the slowest rank's time;
* (b) one training step of the wide MLP (``models.WideMLP``) for every algorithm that takes
  ``hierarchical`` (gradient_allreduce, bytegrad, qadam after its warm-up), flat and
  hierarchical: mean and median over timed steps of the slowest rank's step time.

Bytes: what each rank handed to MPI per call/step (``commlib.stats()`` bus bytes, the max
over ranks), and for hierarchical runs the part of it that crosses nodes (the leaders'
collectives: everything but the node-local reduce and broadcast). On the 4x1 shape every
node has one rank and hierarchical is the flat exchange plus no-op node steps (reference).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402

ALGORITHMS: dict[str, tuple[dict[str, Any], str]] = {
    "gradient_allreduce": ({}, "sgd"),
    "bytegrad": ({}, "sgd"),
    "qadam": ({"warmup_steps": 1}, "qadam"),
}
NODE_LOCAL_OPS = ("reduce", "broadcast")  # hierarchical: the node steps; the rest crosses


# -- worker: one mpiexec job on the cluster -------------------------------------------------

def _slowest(value: float) -> float:
    import numpy as np

    import commlib
    return float(commlib.allreduce(np.array([value]), op="max")[0])


def _bytes(snapshot: dict[str, dict[str, Any]], calls: int) -> dict[str, float]:
    total = sum(v["bus_bytes"] for v in snapshot.values())
    cross = sum(v["bus_bytes"] for op, v in snapshot.items() if op not in NODE_LOCAL_OPS)
    return {"bus_bytes": _slowest(total / calls), "cross_bus_bytes": _slowest(cross / calls)}


def time_allreduce(nbytes: int, hierarchical: bool, budget_s: float) -> dict[str, Any]:
    import numpy as np

    import commlib
    x = np.ones(max(1, nbytes // 4), dtype=np.float32)

    def once() -> float:
        commlib.barrier()
        t = time.perf_counter()
        commlib.allreduce(x, hierarchical=hierarchical)
        return _slowest(time.perf_counter() - t)
    first = once()  # warm-up: connections, node communicators
    reps = max(3, min(20, int(budget_s / max(first, 1e-6))))
    times = [once() for _ in range(reps)]
    return {"bytes": x.nbytes, "median_s": statistics.median(times), "reps": reps,
            "samples_s": times}


def time_training(name: str, hierarchical: bool, args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch
    import torch.nn.functional as F

    import commlib
    from models import WideMLP
    kwargs, kind = ALGORITHMS[name]
    g = torch.Generator().manual_seed(commlib.get_rank())
    x = torch.randn(args.batch, 784, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    torch.manual_seed(0)
    ddp = commlib.DistributedDataParallel(WideMLP(width=args.width, depth=args.depth),
                                          algorithm=name, hierarchical=hierarchical, **kwargs)
    if kind == "qadam":
        from commlib.algorithms.qadam import QAdamOptimizer
        opt = QAdamOptimizer(ddp.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    for _ in range(args.warmup):
        step()
    commlib.barrier()
    commlib.stats(reset=True)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    counters = commlib.stats(reset=True)
    ddp.close()
    slowest = commlib.allreduce(np.array(times), op="max")  # per step, the slowest rank
    out = {"mean_s": float(slowest.mean()), "median_s": float(np.median(slowest)),
           "samples_s": [float(t) for t in slowest]}
    out.update(_bytes(counters, args.steps))
    return out


def _allreduce_bytes(nbytes: int, hierarchical: bool) -> dict[str, float]:
    """Bus bytes of one allreduce call of ``nbytes`` (counted in a separate call so the
    timing's own max-reductions are not in it)."""
    import numpy as np

    import commlib
    x = np.ones(max(1, nbytes // 4), dtype=np.float32)
    commlib.barrier()
    commlib.stats(reset=True)
    commlib.allreduce(x, hierarchical=hierarchical)
    return _bytes(commlib.stats(reset=True), 1)


def worker(args: argparse.Namespace) -> None:
    import torch
    from mpi4py import MPI

    import commlib
    from commlib.mpi.mpi_env import _node
    commlib.init()
    torch.set_num_threads(1)
    if args.chunk_bytes is not None:  # the pipelined hierarchical allreduce's chunk size
        import importlib
        ar = importlib.import_module("commlib.primitives.allreduce")
        ar.PIPELINE_CHUNK_BYTES = args.chunk_bytes or (1 << 62)  # 0: no pipeline
    local_rank, local_size = _node(MPI.COMM_WORLD)
    out: dict[str, Any] = {"local_size": local_size, "allreduce": {}, "training": {}}
    for nbytes in [C.parse_size(s) for s in args.sizes.split(",") if s]:
        row = {}
        for hier in (False, True):
            label = "hierarchical" if hier else "flat"
            row[label] = time_allreduce(nbytes, hier, args.budget)
            row[label].update(_allreduce_bytes(nbytes, hier))
        out["allreduce"][str(nbytes)] = row
    for name in [a for a in args.algorithms.split(",") if a]:
        out["training"][name] = {("hierarchical" if h else "flat"):
                                 time_training(name, h, args) for h in (False, True)}
    if commlib.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump(out, fh)


# -- driver ----------------------------------------------------------------------------------

def drive(args: argparse.Namespace) -> dict[str, Any]:
    from netsim import two_tier
    result: dict[str, Any] = {"environment": C.environment(0), "args": vars(args), "runs": {}}
    for shape in args.shapes.split(","):
        nodes, per_node = (int(v) for v in shape.split("x"))
        for rate in [float(r) for r in args.rates.split(",")]:
            key = f"{shape}@{rate:g}"
            print(f"{key} Mbit/s ...", flush=True)
            with two_tier(nodes, per_node, rate or None, args.delay) as cluster:
                run: dict[str, Any] = {"nodes": nodes, "ranks_per_node": per_node,
                                       "rate_mbit": rate, "shaped": cluster.shaped,
                                       "emulation": cluster.why}
                if nodes > 1:
                    run["measured"] = cluster.measure_bandwidth(0, 1, nbytes=args.probe_bytes)
                    print(f"  measured {run['measured']['mbit']:.0f} Mbit/s, "
                          f"rtt {run['measured']['rtt_ms']:.3f} ms", flush=True)
                with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
                    path = fh.name
                argv = [sys.executable, os.path.abspath(__file__), "--worker", "--out", path,
                        *_passthrough(args)]
                env = {"COMMLIB_TIMEOUT": str(args.timeout)}
                env.update(dict(kv.split("=", 1) for kv in args.env if kv))
                code = cluster.mpiexec(argv, timeout=args.timeout, env=env)
                if code:
                    raise SystemExit(f"worker on {key} exited {code}")
                with open(path) as fh:
                    run.update(json.load(fh))
                os.unlink(path)
            result["runs"][key] = run
            report_run(key, run)
    return result


def _passthrough(args: argparse.Namespace) -> list[str]:
    return ["--sizes", args.sizes, "--algorithms", args.algorithms, "--width", str(args.width),
            "--depth", str(args.depth), "--batch", str(args.batch), "--steps",
            str(args.steps), "--warmup", str(args.warmup), "--budget", str(args.budget)] + (
                [] if args.chunk_bytes is None else ["--chunk-bytes", str(args.chunk_bytes)])


def report_run(key: str, run: dict[str, Any]) -> None:
    rows = []
    for nbytes, r in run["allreduce"].items():
        f, h = r["flat"], r["hierarchical"]
        rows.append([C.fmt_size(int(nbytes)), f"{f['median_s'] * 1e3:.2f}",
                     f"{h['median_s'] * 1e3:.2f}", f"{h['median_s'] / f['median_s']:.2f}",
                     f"{h['cross_bus_bytes'] / 1e6:.2f}"])
    print(C.format_table(["size", "flat ms", "hier ms", "hier/flat", "hier cross MB/rank"],
                         rows, title=f"{key}: allreduce (slowest rank, median)"))
    rows = []
    for name, r in run["training"].items():
        f, h = r["flat"], r["hierarchical"]
        rows.append([name, f"{f['mean_s'] * 1e3:.1f}", f"{f['median_s'] * 1e3:.1f}",
                     f"{h['mean_s'] * 1e3:.1f}", f"{h['median_s'] * 1e3:.1f}",
                     f"{h['mean_s'] / f['mean_s']:.2f}", f"{h['median_s'] / f['median_s']:.2f}",
                     f"{f['bus_bytes'] / 1e6:.2f}", f"{h['cross_bus_bytes'] / 1e6:.2f}"])
    print(C.format_table(["algorithm", "flat mean ms", "flat med ms", "hier mean ms",
                          "hier med ms", "mean ratio", "med ratio", "flat MB/step",
                          "hier cross MB/step"], rows, title=f"{key}: training step"))


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = result["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for key, run in runs.items():
        sizes = [int(s) for s in run["allreduce"]]
        ratio = [r["hierarchical"]["median_s"] / r["flat"]["median_s"]
                 for r in run["allreduce"].values()]
        axes[0].plot(sizes, ratio, marker="o", label=key)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].axhline(0.8, color="tab:red", ls="--", lw=0.8)
    axes[0].set(xscale="log", xlabel="allreduce bytes", ylabel="hierarchical / flat time",
                title="raw allreduce (median, slowest rank)")
    axes[0].legend(fontsize=7)
    keys = list(runs)
    names = list(next(iter(runs.values()))["training"])
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        vals = [runs[k]["training"][name]["hierarchical"]["mean_s"]
                / runs[k]["training"][name]["flat"]["mean_s"] for k in keys]
        axes[1].bar([j + i * width for j in range(len(keys))], vals, width, label=name)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].axhline(0.8, color="tab:red", ls="--", lw=0.8)
    axes[1].set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(keys))])
    axes[1].set_xticklabels(keys, rotation=20, fontsize=8)
    axes[1].set(ylabel="hierarchical / flat mean step time", title="training step (WideMLP)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="2x2,4x1", help="NODESxRANKS, comma-separated")
    p.add_argument("--rates", default="100,1000,10000", help="Mbit/s; 0: unshaped")
    p.add_argument("--delay", type=float, default=0.0, help="one-way ms (needs netem)")
    p.add_argument("--sizes", default="1K,16K,256K,4M,16M,64M")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="per rank")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget", type=float, default=2.0, help="seconds per allreduce size")
    p.add_argument("--chunk-bytes", type=int, default=None,
                   help="hierarchical allreduce pipeline chunk bytes (0: no pipeline; "
                        "default: commlib's)")
    p.add_argument("--probe-bytes", type=int, default=16 << 20)
    p.add_argument("--env", action="append", default=[], help="VAR=VALUE for the ranks")
    p.add_argument("--timeout", type=float, default=900)
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
    if args.json:
        C.write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
