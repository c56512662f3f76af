"""Pipeline schedules and SplitBrain sharding: iteration time, bubble fraction, activation
and model memory.

    mpiexec -n 4 python benchmarks/bench_parallel.py [--ms 4,8,16] [--t-ms 20] [--reps 5]
        [--no-torch] [--json PATH]

**Pipelines.** D = world size stages; each stage is a small Linear followed by an emulated
compute of fixed cost: ``--t-ms`` of sleep in its forward and as much in its backward (the
published bubble formulas assume equal forward and backward), so the comparison is about
the schedule and not about how 4 ranks share 2 cores. For each M, commlib's ``gpipe``,
``1f1b`` and ``chimera`` run one global batch per step, against
``torch.distributed.pipelining``'s ``ScheduleGPipe`` and ``Schedule1F1B`` over gloo on the
same stages (repetitions alternate between the implementations). A step's time is the
slowest rank's; the table gives the median over ``--reps`` steps (after a warm-up step) and
their mean (total / steps).
The measured bubble fraction is ``1 - busy / T``: ``busy`` the rank's time inside the
emulated compute, averaged over ranks, ``T`` the step time (so per-action overheads,
Python and messages, count as bubble); ``waiting`` (commlib only): the share of the step a
rank spent waiting for messages (``Pipeline.last_step``), averaged over ranks. Peak activations: the most
micro-batches whose forward ran and whose backward did not, on the worst rank.

**SplitBrain memory.** A VGG-11 for 32x32 images (CIFAR-10 shape: 8 conv layers, a
512-4096-4096-10 classifier), parameters and gradients per rank under pure data
parallelism against :func:`commlib.parallel.shard_model` over k = 2 and 4 ranks
(``min_params=2**20``: the two big FC layers are sharded, the rest replicated).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import commlib  # noqa: E402

WIDTH, ROWS = 64, 8  # activation of one micro-batch: ROWS x WIDTH float32


def parse(argv=None):
    p = argparse.ArgumentParser(description="pipeline schedules and SplitBrain memory; "
                                            "run under mpiexec -n 4")
    p.add_argument("--ms", default="4,8,16", help="micro-batch counts (4,8,16)")
    p.add_argument("--t-ms", type=float, default=20.0,
                   help="emulated forward (and backward) time of a stage per micro-batch")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    p.add_argument("--no-memory", action="store_true", help="skip the SplitBrain memory table")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    import torch
    torch.set_num_threads(1)
    commlib.init()
    rank, n = commlib.get_rank(), commlib.get_world_size()
    t = args.t_ms / 1000.0
    meter = {"busy": 0.0, "live": 0, "peak": 0, "wait": float("nan")}

    class Emulated(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            start = time.perf_counter()
            time.sleep(t)
            meter["live"] += 1
            meter["peak"] = max(meter["peak"], meter["live"])
            meter["busy"] += time.perf_counter() - start
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            start = time.perf_counter()
            time.sleep(t)
            meter["live"] -= 1
            meter["busy"] += time.perf_counter() - start
            return g

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return Emulated.apply(torch.tanh(self.lin(x)))

    def stages():
        torch.manual_seed(0)
        return [Stage() for _ in range(n)]

    loss_fn = torch.nn.functional.mse_loss
    ms = [int(v) for v in args.ms.split(",")]
    world = commlib.world()
    runners = {}

    def ours(name, m):
        pipe = commlib.pipeline.Pipeline(stages(), schedule=name, micro_batches=m,
                                         loss_fn=loss_fn)
        def step(x, y):
            pipe.train_step(x, y)
            meter["wait"] = pipe.last_step["waiting"] / pipe.last_step["seconds"]
        return step, pipe.schedule.bubble_fraction

    def theirs(name, m):
        import torch.distributed as dist
        from torch.distributed import pipelining as tp
        st = stages()[rank]
        stage = tp.PipelineStage(st, rank, n, torch.device("cpu"), group=gloo)
        cls = tp.ScheduleGPipe if name == "gpipe" else tp.Schedule1F1B
        sched = cls(stage, m, loss_fn=loss_fn)

        def step(x, y):
            C.torch_schedule_step(sched, rank, n, x, y)
        del dist
        return step, None

    gloo = None
    if not args.no_torch:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from torch_gloo import gloo_world
        gloo = gloo_world()

    results = []
    for m in ms:
        x = torch.randn(m * ROWS, WIDTH)
        y = torch.randn(m * ROWS, WIDTH)
        impls = [("commlib", s) for s in ("gpipe", "1f1b", "chimera")]
        if not args.no_torch:
            impls += [("torch", s) for s in ("gpipe", "1f1b")]
        runners = {}
        for impl, s in impls:
            runners[(impl, s)] = (ours if impl == "commlib" else theirs)(s, m)
        samples = {k: [] for k in runners}
        busy = {k: [] for k in runners}
        peaks = {k: 0 for k in runners}
        waits = {k: [] for k in runners}
        for rep in range(args.reps + 1):
            order = list(runners) if rep % 2 == 0 else list(reversed(list(runners)))
            for key in order:
                step = runners[key][0]
                world.barrier()
                meter.update(busy=0.0, live=0, peak=0, wait=float("nan"))
                start = time.perf_counter()
                step(x, y)
                mine = time.perf_counter() - start
                import numpy as np
                stats = commlib.allgather(np.array([mine, meter["busy"], meter["peak"],
                                                    meter["wait"]]))
                if rep > 0:  # the first round is the warm-up
                    samples[key].append(stats[:, 0].max())
                    busy[key].append(stats[:, 1].mean() / stats[:, 0].max())
                    peaks[key] = max(peaks[key], int(stats[:, 2].max()))
                    waits[key].append(stats[:, 3].mean())
        for key in runners:
            impl, s = key
            formula = commlib.pipeline.bubble_formula(s, n, m)
            results.append({
                "impl": impl, "schedule": s, "M": m,
                "step_ms": 1000 * statistics.median(samples[key]),
                "step_mean_ms": 1000 * statistics.mean(samples[key]),
                "bubble": 1 - statistics.median(busy[key]),
                "waiting": statistics.median(waits[key]),
                "formula": formula,
                "ideal_ms": 1000 * t * 2 * m / (1 - formula) if s != "chimera" else
                1000 * t * (2 * m + n - 2),
                "peak_activations": peaks[key],
                "peak_activation_bytes": peaks[key] * ROWS * WIDTH * 4,
            })
    if rank == 0:
        base = {(r["schedule"], r["M"]): r["step_ms"] for r in results if r["impl"] == "torch"}
        rows = []
        for r in results:
            ref = base.get((r["schedule"], r["M"]))
            rows.append([r["impl"], r["schedule"], r["M"], C.fmt(r["step_ms"], 1),
                         C.fmt(r["step_mean_ms"], 1), C.fmt(r["ideal_ms"], 0), C.fmt(r["bubble"], 3),
                         C.fmt(r["waiting"], 3),
                         C.fmt(r["formula"], 3), r["peak_activations"],
                         C.fmt(r["step_ms"] / ref, 2) if ref and r["impl"] == "commlib"
                         else "-"])
        print(C.format_table(["impl", "schedule", "M", "step ms", "mean ms", "ideal ms", "bubble",
                              "waiting",
                              "formula", "peak act.", "vs torch"], rows,
                             title=f"D={n} stages, {args.t_ms:g} ms forward and backward "
                                   f"per stage and micro-batch, median of {args.reps}"))
    memory = [] if args.no_memory else splitbrain_memory(rank, n)
    if rank == 0 and memory:
        print(C.format_table(["layout", "params/rank", "param+grad MiB/rank", "saved"],
                             [[m["layout"], m["params"], C.fmt(m["mib"], 1),
                               f"{100 * m['saved']:.0f}%"] for m in memory],
                             title="VGG-11 (CIFAR-10 shape), float32"))
    if args.json and rank == 0:
        C.write_json(args.json, {"env": C.environment(n), "pipelines": results,
                                 "memory": memory})
    return 0


def vgg11():
    import torch
    from torch import nn
    layers, c = [], 3
    for v in [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU()]
            c = v
    layers += [nn.Flatten(), nn.Linear(512, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
               nn.Linear(4096, 10)]
    torch.manual_seed(0)
    return nn.Sequential(*layers)


def splitbrain_memory(rank, n):
    """Parameters (and as many gradients) per rank: data parallel vs sharded over k."""
    import numpy as np
    full = sum(p.numel() for p in vgg11().parameters())
    out = [{"layout": "data parallel (replicated)", "params": full,
            "mib": 2 * 4 * full / 2 ** 20, "saved": 0.0}]
    for k in (2, 4):
        if n % k:
            continue
        topo = commlib.Topology(tp=k)
        model = commlib.parallel.shard_model(vgg11(), topo.group("tp"), min_params=1 << 20)
        mine = sum(p.numel() for p in model.parameters())
        worst = int(commlib.allgather(np.array([mine]))[:, 0].max())
        out.append({"layout": f"SplitBrain, FC sharded over k={k}", "params": worst,
                    "mib": 2 * 4 * worst / 2 ** 20, "saved": 1 - worst / full})
        del model
        topo.free()
    return out


if __name__ == "__main__":
    sys.exit(main())
