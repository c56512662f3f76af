"""Automatic pipeline partitioning (:func:`commlib.pipeline.partition`) against an
equal-layers split, on the GPT workload of ``benchmarks/gpt.py``.

    python benchmarks/bench_partition.py [--size default] [--stages 2,4] [--reps 7]
    mpiexec -n 4 python benchmarks/bench_partition.py --steps 6     # + Pipeline step times

**Balance** (every rank, one process's measurement printed by rank 0): for each stage
count S the automatic cut (``balance="time"``) and the equal-layers split (the embedding
with the first blocks, ``layers / S`` blocks per stage, the head with the last) are each
timed stage by stage on one micro-batch: forward + backward of the stage alone, the least
of ``--reps`` (stages alternate within each repetition), the median of 3 such rounds. The
table gives each stage's time beside partition()'s prediction (its summed node times),
the slowest over the mean, and the slowest over the automatic cut's slowest.

**Steps** (``--steps k`` under mpiexec at D ranks, S = D): a 1F1B :class:`Pipeline` of each
cut trains ``k`` steps of ``--micro`` micro-batches; the median step time (slowest rank) of
each, alternating. Ranks share this machine's cores: compare the ratio within one run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

import _common as C  # noqa: E402
import commlib  # noqa: E402
import commlib.mpi.mpi_impl  # noqa: E402
import gpt  # noqa: E402


def equal_layers(model: torch.nn.Module, stages: int, x: torch.Tensor, me) -> list:
    """Cut points giving each stage ``layers / stages`` blocks (the first stage also the
    embedding, the last the final norm and head)."""
    probe = commlib.pipeline.partition(model, 1, x, balance="params", group=me)
    layers = len(model.blocks)
    firsts = []
    for k in range(1, stages):
        block = k * layers // stages
        first = next(i for i, n in enumerate(probe.nodes) if n.startswith(f"blocks_{block}_"))
        firsts.append(max(i for i in probe.cuttable if i <= first))
    return firsts


def stage_times(stages: list, x: torch.Tensor, reps: int) -> list:
    """Seconds of forward + backward of each stage alone on ``x``: the least of ``reps``
    (other processes only ever add time)."""
    inputs, h = [], x
    with torch.no_grad():
        for s in stages:
            inputs.append(h)
            h = s(h)
    samples = [[] for _ in stages]
    for _ in range(reps + 1):
        for k, s in enumerate(stages):
            xin = inputs[k].detach()
            if xin.is_floating_point():
                xin.requires_grad_(True)
            t0 = time.perf_counter()
            y = s(xin)
            y.backward(torch.ones_like(y))
            samples[k].append(time.perf_counter() - t0)
            for p in s.parameters():
                p.grad = None
    return [min(v[1:]) for v in samples]


def gpt_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over every position."""
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                             targets.reshape(-1))


def step_time(stages: list, x: torch.Tensor, y: torch.Tensor, micro: int, steps: int,
              pipes: dict, key: str) -> float:
    pipe = pipes.get(key)
    if pipe is None:
        pipe = pipes[key] = commlib.pipeline.Pipeline(
            stages, schedule="1f1b", micro_batches=micro,
            loss_fn=gpt_loss)
        pipe.train_step(x, y)   # shapes agreed, warm-up
    commlib.barrier()
    t0 = time.perf_counter()
    pipe.train_step(x, y)
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    commlib.allreduce(took, op=commlib.ReduceOp.MAX)
    return float(took[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="default", choices=sorted(gpt.SIZES))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--stages", default="2,4")
    p.add_argument("--batch", type=int, default=8, help="rows of one micro-batch")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--json", default=None, help="write the step times here (rank 0)")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--torch", action="store_true",
                   help="with --steps: also torch.distributed.pipelining's own splitter "
                        "(pipeline() with an equal-layers split_spec) and Schedule1F1B "
                        "over gloo")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    commlib.init()
    rank, n = commlib.get_rank(), commlib.get_world_size()
    cfg = gpt.SIZES[args.size]
    cfg = gpt.Config(d_model=cfg.d_model, layers=args.layers, heads=cfg.heads,
                     context=args.context)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.batch, args.context), generator=g)
    me = commlib.primitives.group_from_ranks([rank])
    say = print if rank == 0 else (lambda *a, **k: None)
    rows: list = []
    say(f"GPT d_model={cfg.d_model} layers={cfg.layers} context={cfg.context}, micro-batch "
        f"{args.batch} rows; stage times: fwd+bwd alone, min of {args.reps}, "
        f"median of 3 rounds; 'predicted': partition()'s summed node times")
    for count in [int(s) for s in args.stages.split(",")]:
        model = gpt.build(cfg)
        t0 = time.perf_counter()
        auto = commlib.pipeline.partition(model, count, x, group=me)
        took = time.perf_counter() - t0
        naive = commlib.pipeline.partition(model, count, x, balance="params", group=me,
                                           cuts=equal_layers(model, count, x, me))
        times = {"auto": [], "equal": []}
        for _ in range(3):   # alternate the two cuts
            for key, cut in (("auto", auto), ("equal", naive)):
                times[key].append(stage_times(list(cut), x, args.reps))
        best = {k: [statistics.median(v[i] for v in runs) for i in range(count)]
                for k, runs in times.items()}
        say(f"\nS={count}: partition() took {took:.2f} s over {len(auto.nodes)} nodes")
        for key, cut in (("auto", auto), ("equal", naive)):
            ts = best[key]
            firsts = [cut.nodes[s] for s in cut.starts]
            say(f"  {key:5s} starts {firsts}")
            b = cut.starts + [len(auto.costs)]
            pred = [1e3 * sum(auto.costs[i:j]) for i, j in zip(b, b[1:])]
            say(f"        predicted ms {[round(t, 2) for t in pred]}")
            say(f"        stage ms {[round(1e3 * t, 2) for t in ts]}  max/mean "
                f"{max(ts) / statistics.mean(ts):.3f}  max/auto max "
                f"{max(ts) / max(best['auto']):.3f}  sent {cut.boundary_bytes} B")
        if args.steps and count == n:
            xs = torch.randint(0, 256, (args.batch * args.micro, args.context), generator=g)
            ys = torch.randint(0, 256, (args.batch * args.micro, args.context), generator=g)
            # the cut every rank uses: rank 0's (measurements differ between ranks)
            pipes: dict = {}
            stages = {}
            for key in ("auto", "equal"):
                cut = auto if key == "auto" else naive
                starts = torch.tensor(cut.starts)
                commlib.broadcast(starts, src=0)
                stages[key] = commlib.pipeline.partition(
                    gpt.build(cfg), count, x, balance="params",
                    cuts=[int(s) for s in starts[1:]])
            keys = ["auto", "equal"]
            torch_step = None
            if args.torch:
                torch_step = torch_pipeline(cfg, count, x, args.micro)
                keys.append("torch")
            steps: dict = {k: [] for k in keys}
            for _ in range(args.steps):
                for key in keys:
                    if key == "torch":
                        steps[key].append(torch_step(xs, ys))
                    else:
                        steps[key].append(step_time(list(stages[key]), xs, ys, args.micro,
                                                    args.steps, pipes, key))
            med = {k: statistics.median(v) for k, v in steps.items()}
            a = med["auto"]
            say(f"  1F1B step at {n} ranks, {args.micro} micro-batches: "
                + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items())
                + "; " + ", ".join(f"{k}/auto {v / a:.3f}" for k, v in med.items()
                                   if k != "auto"))
            if args.json and rank == 0:
                rows.append({"stages": count, "ranks": n, "micro_batches": args.micro,
                             "step_s": med, "samples_s": steps})
            for pipe in pipes.values():
                pipe.close()
    if args.json and rank == 0:
        import json
        Path(args.json).write_text(json.dumps(
            {"benchmark": "bench_partition", "size": args.size, "layers": args.layers,
             "context": args.context, "batch": args.batch, "ranks": n,
             "mpi": commlib.mpi.mpi_impl.library_version().splitlines()[0],
             "note": "ranks share this machine's 2 cores: compare ratios within one run",
             "steps": rows}, indent=1))
    return 0


def torch_pipeline(cfg, count: int, x: torch.Tensor, micro: int):
    """torch.distributed.pipelining's own splitter on the same model: ``pipeline()``
    traced with a split_spec that starts a stage every ``layers / count`` blocks (torch
    2.13 ships no automatic split policy: its documentation writes the split points by
    hand, as here), this rank's stage built over gloo, run by ``Schedule1F1B``. Returns a
    function (inputs, targets) -> the step's seconds (the slowest rank's)."""
    from torch.distributed import pipelining as tpp
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from torch_gloo import gloo_world
    gloo = gloo_world()
    rank = commlib.get_rank()
    model = gpt.build(cfg)
    spec = {f"blocks.{k * cfg.layers // count}": tpp.SplitPoint.BEGINNING
            for k in range(1, count)}
    pipe = tpp.pipeline(model, mb_args=(x,), split_spec=spec)
    stage = pipe.build_stage(rank, torch.device("cpu"), group=gloo)
    sched = tpp.Schedule1F1B(stage, micro, loss_fn=gpt_loss)

    def step(xs: torch.Tensor, ys: torch.Tensor) -> float:
        commlib.barrier()
        t0 = time.perf_counter()
        C.torch_schedule_step(sched, rank, count, xs, ys)
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        commlib.allreduce(took, op=commlib.ReduceOp.MAX)
        return float(took[0])
    step(torch.randint(0, 256, (x.shape[0] * micro, x.shape[1])),
         torch.randint(0, 256, (x.shape[0] * micro, x.shape[1])))   # warm-up
    return step


if __name__ == "__main__":
    sys.exit(main())
