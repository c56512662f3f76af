"""Time to accuracy of every algorithm and torch DDP on an emulated cluster.

    python benchmarks/bench_time_to_accuracy.py --shapes 2x2,4x1 --rates 1000 --seeds 0,1,2 \\
        --models cnn,mlp --json benchmarks/results/time_to_accuracy.json \\
        --plot benchmarks/results/time_to_accuracy.png
    python benchmarks/bench_time_to_accuracy.py --quick      # smoke test, < 3 min

Every contender (commlib's algorithms and torch DDP over gloo) trains the same model on
the same data with the same seed, per-rank batch and learning-rate schedule: scikit-learn's
digits with ``train_digits``' 80/20 split (``load_digits_split(seed)``), a distributed
sampler, and either the digits CNN or a communication-heavy wide MLP (64 -> W -> W -> 10).
Schedule: SGD (momentum 0.9) at ``--lr``, Adam-family (qadam) at ``--lr / 10``, both times
a cosine factor that falls from 1 to 0 over the run.

Every ``--eval-every`` steps the clock stops, EACH rank scores the replica it holds on the
whole test set (never an averaged model), and the clock restarts after a barrier. The
wall time of a segment is its slowest rank's; the curve is (wall time, steps, accuracy of
every replica, bytes). Target accuracy per (shape, model, seed): the final accuracy of
synchronous training (``gradient_allreduce``, flat) minus ``--tolerance`` (0.5 pp). A
contender reaches it at the first evaluation where its WORST replica is at or above it
(``None`` if never). Bytes: what rank 0 handed to MPI (``commlib.stats()``), per sample of
rank 0; torch DDP over gloo is not seen by commlib, so its bytes are computed from the
parameter sizes (one allreduce of every gradient per step). Step times: each rank's mean
(total / steps) and median, slowest rank.

``control_nocomm`` is a negative control: each rank trains alone (no communication) on a
label-skewed shard (sorted by label), so no replica can reach the target; the report must
say so. Cluster shapes (``NxR``: N nodes, R ranks each) run on ``netsim.two_tier``: each
node a network namespace (shared memory inside), nodes joined by links of ``--rates``
Mbit/s each way; without root it runs unshaped and ``JSON[...]["emulation"]`` says so.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402
from bench_time_to_accuracy_contenders import (  # noqa: E402
    CONTENDERS,
    CONTROL,
    DEFAULT_ALGORITHMS,
    DESIGN,
    PEER,
    SYNC,
    parse_set,
)
from bench_time_to_accuracy_report import (  # noqa: E402
    headline_markdown,
    markdown,
    plot,
    report,
    score,
    summarize,
)
from bench_time_to_accuracy_worker import worker  # noqa: E402

# the module's parts: bench_time_to_accuracy_contenders (who trains with what),
# _worker (one mpiexec job), _report (scoring, tables, plot); this file drives the grid

# -- driver --------------------------------------------------------------------------------

def parse_shape(text: str) -> tuple[int, int]:
    try:
        nodes, per = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not NODESxRANKS (e.g. 2x2)") from None
    if nodes < 1 or per < 1 or nodes * per < 2:
        raise SystemExit(f"--shapes: {text!r} needs at least 2 ranks")
    return nodes, per


def pinning(nodes: int, per: int, pin: str) -> list[list[int]] | None:
    """The cores of each node (``two_tier(cpus=)``): one core per rank, node ``i`` on cores
    ``i*per .. i*per+per-1``, when ``pin`` is ``on``, or ``auto`` and the machine has a core
    for every rank (2x1 on 2 cores: each rank computes alone, the link is what is shared);
    ``None`` otherwise (the ranks share the cores: compute-bound shapes)."""
    if pin == "off" or (pin == "auto" and nodes * per > (os.cpu_count() or 1)):
        return None
    if nodes * per > (os.cpu_count() or 1):
        raise SystemExit(f"--pin on: {nodes}x{per} needs {nodes * per} cores, this machine "
                         f"has {os.cpu_count()}")
    return [list(range(i * per, (i + 1) * per)) for i in range(nodes)]


def launch(nodes: int, per: int, rate: float, delay_ms: float, argv: list[str],
           timeout: float, pin: str = "auto") -> tuple[int, dict[str, Any]]:
    """Run ``argv`` (a python command line, without mpiexec) on the emulated two-tier
    cluster (``netsim.two_tier``), after measuring its links."""
    from netsim import two_tier
    cpus = pinning(nodes, per, pin)
    with two_tier(nodes=nodes, ranks_per_node=per, rate_mbit=rate or None,
                  delay_ms=delay_ms, cpus=cpus) as cluster:
        info: dict[str, Any] = {"emulation": cluster.why, "shaped": cluster.shaped,
                                "delay_applied": cluster.delay_applied, "cpus": cpus}
        if cluster.shaped:
            for label, (a, b) in (("inter_node", (0, 1)), ("intra_node", (0, 0))):
                if (label == "inter_node" and nodes < 2) or (label == "intra_node" and per < 2):
                    continue
                try:
                    info[f"measured_{label}"] = cluster.measure_bandwidth(a, b, nbytes=4 << 20)
                except Exception as exc:  # informative, not required
                    info[f"measured_{label}"] = f"failed: {exc}"
        return cluster.mpiexec(argv, timeout=timeout), info


def run_job(args: argparse.Namespace, nodes: int, per: int, rate: float, model: str,
            seed: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        path = fh.name
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--out", path,
            "--model", model, "--seed", str(seed), "--epochs", str(args.epochs),
            "--batch", str(args.batch), "--lr", str(args.lr), "--width", str(args.width),
            "--eval-every", str(args.eval_every), "--algorithms", args.algorithms,
            "--gpt-size", args.gpt_size, "--gpt-steps-per-epoch", str(args.gpt_steps_per_epoch),
            "--gpt-lr", str(args.gpt_lr), "--gpt-eval-windows", str(args.gpt_eval_windows)]
    if args.gpt_bytes:
        argv += ["--gpt-bytes", str(args.gpt_bytes)]
    for item in args.set:
        argv += ["--set", item]
    started = time.perf_counter()
    code, info = launch(nodes, per, rate, args.delay_ms, argv, args.timeout, args.pin)
    if code != 0:
        raise SystemExit(f"worker {nodes}x{per} {rate:g} Mbit/s {model} seed {seed} "
                         f"exited {code}")
    with open(path) as fh:
        out = json.load(fh)
    os.unlink(path)
    out.update(info, job_s=time.perf_counter() - started)
    return out



def drive(args: argparse.Namespace) -> dict[str, Any]:
    from netsim import can_shape
    shaped, why = can_shape()
    result: dict[str, Any] = {
        "shaped": shaped, "why": why, "tolerance": args.tolerance,
        "config": {k: getattr(args, k) for k in ("epochs", "batch", "lr", "width",
                                                  "eval_every", "delay_ms", "pin", "algorithms",
                                                  "gpt_size", "gpt_steps_per_epoch",
                                                  "gpt_lr", "gpt_bytes", "loss_tolerance",
                                                  "gpt_eval_windows", "set")},
        "target_rule": f"final worst-replica accuracy of {SYNC} (flat) at the same shape, "
                       f"model and seed, minus {args.tolerance * 100:g} pp (gpt: its final "
                       f"worst-replica validation loss plus {args.loss_tolerance * 100:g} %)",
        "design_bus_ratio": DESIGN, "panels": {}}
    for shape in args.shapes.split(","):
        nodes, per = parse_shape(shape)
        for rate in [float(r) for r in args.rates.split(",")]:
            for model in args.models.split(","):
                key = f"{nodes}x{per} {rate:g}Mbit {model}"
                runs = []
                for seed in [int(s) for s in args.seeds.split(",")]:
                    print(f"{key} seed {seed} ...", flush=True)
                    run = run_job(args, nodes, per, rate, model, seed)
                    run["seed"] = seed
                    score(run, args.tolerance, args.loss_tolerance)
                    runs.append(run)
                result["panels"][key] = {"nodes": nodes, "ranks_per_node": per,
                                         "rate_mbit": rate, "model": model, "runs": runs,
                                         "summary": summarize(runs)}
                if args.json:   # partial results survive an interrupted sweep
                    C.write_json(args.json, result)
    return result


def combine(paths: list[str]) -> dict[str, Any]:
    """One result from the JSON files of several runs (e.g. one per shape, or one per
    shape, rate and seed, each taken under the benchmark lock): their panels side by side,
    the runs of one panel found in several files joined (by seed; a seed twice: the later
    file's) and summarized again; the first file's settings. Panels ordered by rate (the
    fastest first, unshaped last), then shape."""
    result: dict[str, Any] | None = None
    for path in paths:
        with open(path) as fh:
            part = json.load(fh)
        if result is None:
            result = part
            result["combined_from"] = []
        else:
            for key, panel in part["panels"].items():
                have = result["panels"].get(key)
                if have is None:
                    result["panels"][key] = panel
                    continue
                runs = {r["seed"]: r for r in have["runs"] + panel["runs"]}
                have["runs"] = [runs[seed] for seed in sorted(runs)]
                have["summary"] = summarize(have["runs"])
        result["combined_from"].append(os.path.basename(path))
    if result is None:
        raise SystemExit("--combine: no files given")
    order = sorted(result["panels"].items(),
                   key=lambda kv: (kv[1]["model"], kv[1]["rate_mbit"] == 0,
                                   -kv[1]["rate_mbit"], -kv[1]["ranks_per_node"]))
    result["panels"] = dict(order)
    return result


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 2x1 at 1000 Mbit/s, CNN, gradient_allreduce and "
                        "local_sgd, torch DDP and the control, 3 epochs, one seed")
    p.add_argument("--shapes", default="2x2,4x1", help="NODESxRANKS, comma-separated")
    p.add_argument("--rates", default="1000", help="inter-node Mbit/s, comma-separated; 0: none")
    p.add_argument("--delay-ms", type=float, default=0.5)
    p.add_argument("--pin", choices=("auto", "on", "off"), default="auto",
                   help="one core per rank (auto: where the machine has one per rank)")
    p.add_argument("--models", default="cnn,mlp")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--algorithms", default=",".join(DEFAULT_ALGORITHMS))
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="SGD rate; Adam-family: lr / 10")
    p.add_argument("--width", type=int, default=512, help="hidden width of the mlp model")
    p.add_argument("--eval-every", type=int, default=4, help="steps between evaluations")
    p.add_argument("--tolerance", type=float, default=0.005,
                   help="target = sync final accuracy minus this (fraction; 0.005 = 0.5 pp)")
    p.add_argument("--loss-tolerance", type=float, default=0.01,
                   help="GPT target = sync final validation loss times 1 + this")
    p.add_argument("--gpt-size", default="small", choices=("default", "small", "mini", "tiny", "wide"),
                   help="GPT size (benchmarks/gpt.py): default 1.85 M, small 1.05 M params")
    p.add_argument("--gpt-steps-per-epoch", type=int, default=16)
    p.add_argument("--gpt-lr", type=float, default=3e-3, help="AdamW rate (qadam: / 10)")
    p.add_argument("--gpt-bytes", type=int, default=None, help="cut the corpus' sides")
    p.add_argument("--gpt-eval-windows", type=int, default=32)
    p.add_argument("--set", action="append", default=[], metavar="NAME.KEY=JSON",
                   help="override one argument of one contender (repeatable), e.g. "
                        "diloco.sync_every=4")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--markdown", default=None, help="also write the tables as Markdown")
    p.add_argument("--combine", default=None, metavar="A.json,B.json",
                   help="no runs: merge the panels of earlier --json files, report, plot")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--model", default="cnn", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for item in args.set:
        try:
            parse_set(item)
        except ValueError as exc:
            p.error(str(exc))
    for name in args.algorithms.split(","):
        if name not in CONTENDERS:
            p.error(f"--algorithms: unknown contender {name!r} (known: {', '.join(CONTENDERS)})")
    if args.quick:
        args.shapes, args.rates, args.models, args.seeds = "2x1", "1000", "cnn", "0"
        args.algorithms = f"{SYNC},local_sgd,{PEER},{CONTROL}"
        args.epochs = 3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.json = args.json or str(C.RESULTS_DIR / "time_to_accuracy_quick.json")
        args.plot = args.plot or str(C.RESULTS_DIR / "time_to_accuracy_quick.png")
    if args.combine:
        result = combine(args.combine.split(","))
    else:
        result = drive(args)
    report(result)
    if args.json:
        C.write_json(args.json, result)
        print(f"JSON: {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"plot: {args.plot}")
    if args.markdown:
        with open(args.markdown, "w") as fh:
            if any(p.get("model") == "gpt" for p in result["panels"].values()):
                fh.write(headline_markdown(result) + "\n")
            fh.write(markdown(result))
        print(f"markdown: {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
