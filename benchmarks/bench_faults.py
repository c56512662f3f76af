"""Fault tolerance (issue 21): recovery time after a kill, steps lost, and the cost of the
fault-tolerant mode on steps without failures.

    python benchmarks/bench_faults.py --json results/faults.json

Runs on the MPI library of the Python that runs it (MPICH, Open MPI with ULFM, Intel MPI:
``tests/elastic_common.py`` launches as :mod:`commlib.mpi.mpi_impl` says; the report names it).

**Recovery.** ``tests/elastic_train_program.py`` jobs, each rank a failure domain of its own
and the launcher keeping the others running (MPICH: one hydra proxy per rank,
``-disable-auto-cleanup``; Open MPI: ``--with-ft ulfm``), a float64 MLP of about 2 MB or
64 MB trained through ``commlib.elastic`` with ``gradient_allreduce`` (25 MB buckets); rank
``n-1`` SIGKILLs itself in the middle of the backward of step ``--at``. Measured per run: seconds from
the kill (the victim's clock, the same host) to the next step completed by every
survivor (max over survivors), the survivors' own recovery (PeerFailure caught to state
restored), committed steps lost (steps missing from, or doubled in, the ledger the state
carries: must be 0) and the steps run again (the step in flight at the kill). With a
replacement (``--replace yes``): the survivors spawn one on the dead rank's host and send it
the state; the time is then to the first step completed by all ranks, the replacement
included (it must start Python and import torch: most of that time). With warm spares
(``--spares 1``: ``n + 1`` ranks, ``run(spares=1)``): the spare has imported everything and
built its model while standing by; it joins the survivors and receives the state by
broadcast; the time is again to the first step completed by all ``n`` ranks, the spare
included. A job without failure per cell then reports the trainers' step with an idle spare
and the spare's CPU share while standing by (its steady-state cost).

**Exactness** (``--exactness RUNS``): ``RUNS`` 4-rank jobs per fault kind (``kill``,
``exit``: one rank mid-backward; ``two``: two successive kills; ``lag``: the survivors one
step apart; ``KIND:ALGORITHM`` with another algorithm), each checked as the tests check:
every survivor finishes, every step applied once, parameters bit for bit those of the
reference that shrinks at the agreed steps.

**Overhead.** Under ``mpiexec``, each rank trains two copies of bench_ddp's model (WideMLP
784-1024x4-10, float32, batch 64, 25 MB buckets) with ``commlib.DistributedDataParallel``:
one over a fault-tolerant group (every collective nonblocking, waits interruptible), one
over an ordinary one (blocking waits), steps interleaved (A, B, A, B...) in the same job so
that the machine's noise hits both alike; reported: median step of each and the ratio. The
fault-tolerant job's background watcher (one PMI query every 20 ms) runs during both.

The machine these figures come from is shared (other jobs run on its 2 cores): absolute
times are not comparable across runs; the ratios of one run are.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests")
sys.path.insert(0, TESTS)

PROGRAM = os.path.join(TESTS, "elastic_train_program.py")
WIDTHS = {"2MB": 500, "64MB": 2890}  # float64 MLP 16-w-w-4: about w*w parameters


def recovery_run(n: int, model: str, steps: int, at: int, timeout: float,
                 replace: bool = False, spares: int = 0) -> dict:
    """One job of ``n`` trainers (and ``spares`` warm spares: ``n + spares`` ranks), the
    last trainer SIGKILLed mid-backward of step ``at``."""
    from elastic_common import rank_hosts, results, run_job
    hosts = rank_hosts(n + spares)  # where a replacement goes ("": the launcher's choice)
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as out:
        status, seconds, text, left = run_job(
            n + spares, [PROGRAM, out, "--steps", str(steps), "--fault", "kill", "--victims",
                         str(n - 1), "--at", str(at), "--width", str(WIDTHS[model]),
                         "--bucket-mb", "25", "--spares", str(spares)] +
            (["--replace"] if replace else []), timeout,
            COMMLIB_TIMEOUT="120", ELASTIC_HOSTS=hosts)
        found = results(out)
        fault_path = os.path.join(out, f"fault{n - 1}.json")
        full = replace or spares
        if len(found) != n - (0 if full else 1) or not os.path.exists(fault_path) or left:
            return {"ok": False, "status": status, "tail": text[-1500:]}
        with open(fault_path) as f:
            killed = json.load(f)["time"]
    first_after = max(min(t for _, t in r["times"] if t > killed) for r in found.values())
    before = [t for _, t in found[0]["times"] if t < killed]  # rank 0 survives
    step_s = statistics.median(b - a for a, b in zip(before, before[1:])) \
        if len(before) > 2 else float("nan")
    if replace and not spares:
        found = {k: v for k, v in found.items() if k != n - 1}  # the survivors' recovery
    if spares:  # the survivors' recovery (the spare's record is its merge alone)
        found = {k: v for k, v in found.items() if k < n}
    ledger = next(iter(found.values()))["ledger"]
    lost = len({s for s, _ in ledger} ^ set(range(1, steps + 1))) + \
        (len(ledger) - len({s for s, _ in ledger}))
    rec = next(iter(found.values()))["recoveries"][0]
    merged = [x for x in next(iter(found.values()))["recoveries"] if x.get("joined")]
    return {"ok": True, "ranks": n, "model": model, "replace": replace, "spares": spares,
            "merge_s": merged[0]["seconds"] if merged else None,
            "kill_to_next_step_s": first_after - killed, "step_s": step_s,
            "recovery_s": max(r["recoveries"][0]["seconds"] for r in found.values()),
            "committed_steps_lost": lost, "agreed_step": rec["step"],
            "steps_rerun": at + 1 - rec["step"], "job_s": seconds}


def idle_spare_run(n: int, model: str, steps: int, timeout: float, spares: int) -> dict:
    """A job of ``n`` trainers and ``spares`` idle spares without failure: the trainers'
    median step and each spare's CPU share while standing by (CPU seconds / wall seconds
    inside ``run``)."""
    from elastic_common import results, run_job
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as out:
        status, seconds, text, left = run_job(
            n + spares, [PROGRAM, out, "--steps", str(steps), "--width", str(WIDTHS[model]),
                         "--bucket-mb", "25", "--spares", str(spares)], timeout,
            COMMLIB_TIMEOUT="120")
        found, idle = results(out), results(out, "spare")
    if len(found) != n or len(idle) != spares or left:
        return {"ok": False, "status": status, "tail": text[-1500:]}
    times = [t for _, t in found[0]["times"]]
    return {"ok": True, "ranks": n, "model": model, "spares": spares,
            "step_s": statistics.median(b - a for a, b in zip(times, times[1:])),
            "spare_cpu_share": max(r["cpu_s"] / r["wall_s"] for r in idle.values()),
            "spare_wall_s": max(r["wall_s"] for r in idle.values()), "job_s": seconds}


# Fault kinds of the exactness runs: program arguments (4 ranks, one proxy per rank).
KINDS = {"kill": ["--fault", "kill"], "exit": ["--fault", "exit"],
         "two": ["--fault", "kill", "--victims", "3,2", "--at", "8,16"],
         "lag": ["--fault", "lag"]}


def exactness_runs(kind: str, runs: int, steps: int, timeout: float,
                   references: dict) -> list[dict]:
    """``runs`` jobs of fault ``kind`` at 4 ranks: each must finish on the survivors with
    every step applied once and parameters bit for bit those of the reference run that
    shrinks at the agreed steps (one reference job per distinct agreement, cached)."""
    import numpy as np

    from elastic_common import reference_args, results, run_job
    fault, _, algorithm = kind.partition(":")  # e.g. "kill:bytegrad"
    extra = KINDS[fault] + (["--algorithm", algorithm] if algorithm else [])
    out_runs = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="bench-faults-") as out:
            status, seconds, text, left = run_job(
                4, [PROGRAM, out, "--steps", str(steps)] + extra, timeout,
                COMMLIB_TIMEOUT="120")
            found = results(out)
        ok = bool(found) and not left and all(
            [s for s, _ in r["ledger"]] == list(range(1, steps + 1)) for r in found.values())
        agreed = reference_args(found) if ok else None
        key = (algorithm, agreed)
        if ok and key not in references:
            with tempfile.TemporaryDirectory(prefix="bench-faults-ref-") as ref_dir:
                code, _, _, _ = run_job(4, [PROGRAM, ref_dir, "--steps", str(steps),
                                            "--victims", agreed[0], "--reference",
                                            agreed[1]] + extra[len(KINDS[fault]):],
                                        timeout, keep_running=False, COMMLIB_TIMEOUT="120")
                references[key] = results(ref_dir) if code == 0 else {}
        exact = ok and all(
            rank in references[key] and np.array_equal(
                np.frombuffer(bytes.fromhex(r["params"])),
                np.frombuffer(bytes.fromhex(references[key][rank]["params"])))
            for rank, r in found.items())
        out_runs.append({"kind": kind, "ok": ok, "exact": exact, "status": status,
                         "survivors": sorted(found), "agreed": agreed, "job_s": seconds,
                         "tail": "" if exact else text[-1500:]})
    return out_runs


# -- overhead (runs under mpiexec) ------------------------------------------------------------

def overhead_worker(args: argparse.Namespace) -> None:
    import copy

    import numpy as np
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, HERE)
    import commlib
    from commlib.base.options import options
    from models import WideMLP
    torch.manual_seed(0)
    torch.set_num_threads(1)
    commlib.init()
    base = WideMLP(784, args.width, args.depth, 10)
    copies = {"blocking": base, "fault_tolerant": copy.deepcopy(base)}
    wrappers = {}
    for name, model in copies.items():
        options.fault_tolerant = name == "fault_tolerant"
        wrappers[name] = commlib.DistributedDataParallel(model, bucket_cap_mb=25)
    options.fault_tolerant = False
    assert wrappers["fault_tolerant"].process_group.comm.mpi.__class__.__name__ == "FTComm"
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in copies.items()}
    g = torch.Generator().manual_seed(commlib.get_rank())
    x, y = torch.randn(args.batch, 784, generator=g), torch.randint(0, 10, (args.batch,),
                                                                    generator=g)
    times: dict[str, list[float]] = {k: [] for k in copies}
    for i in range(args.warmup + args.steps):
        for name in (("blocking", "fault_tolerant") if i % 2 else
                     ("fault_tolerant", "blocking")):
            commlib.barrier()
            t0 = time.perf_counter()
            optimizers[name].zero_grad()
            F.cross_entropy(wrappers[name](x), y).backward()
            optimizers[name].step()
            dt = time.perf_counter() - t0
            dt = float(commlib.allreduce(np.array([dt]), op="max")[0])
            if i >= args.warmup:
                times[name].append(dt)
    if commlib.get_rank() == 0:
        medians = {k: statistics.median(v) for k, v in times.items()}
        result = {"ranks": commlib.get_world_size(), "launch": args.launch,
                  "blocking_ms": 1e3 * medians["blocking"],
                  "fault_tolerant_ms": 1e3 * medians["fault_tolerant"],
                  "ratio": medians["fault_tolerant"] / medians["blocking"],
                  "steps": args.steps}
        with open(args.out, "w") as f:
            json.dump(result, f)
    for w in wrappers.values():
        w.close()


def overhead_run(n: int, per_rank: bool, args: argparse.Namespace) -> dict:
    from elastic_common import run_job
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    try:
        launch = "one proxy per rank" if per_rank else "mpiexec -n"
        status, _, text, _ = run_job(
            n, [os.path.abspath(__file__), "--overhead-worker", "--out", out, "--steps",
                str(args.overhead_steps), "--launch", launch], args.timeout,
            per_rank=per_rank, COMMLIB_TIMEOUT="300")
        if status != 0:
            return {"ok": False, "status": status, "tail": text[-1500:]}
        with open(out) as f:
            return dict(json.load(f), ok=True)
    finally:
        os.unlink(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="4,8")
    p.add_argument("--models", default="2MB,64MB")
    p.add_argument("--runs", type=int, default=3, help="runs per recovery cell")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--at", type=int, default=8)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--overhead-steps", type=int, default=30)
    p.add_argument("--skip-recovery", action="store_true")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--replace", default="no,yes", help="with a replacement joining: no,yes")
    p.add_argument("--spares", type=int, default=0,
                   help="also cells with this many warm spares (run(spares=K), no spawn), "
                        "and a job without failure measuring the idle spares' cost")
    p.add_argument("--exactness", type=int, default=0, metavar="RUNS",
                   help="also RUNS jobs per fault kind, each checked bit for bit")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help="fault kinds of --exactness, each KIND or KIND:ALGORITHM")
    p.add_argument("--json")
    # overhead worker (under mpiexec)
    p.add_argument("--overhead-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--launch", default="", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    if args.overhead_worker:
        overhead_worker(args)
        return 0
    from helpers import mpi_impl
    report: dict = {"mpi": mpi_impl().describe(), "recovery": [], "overhead": [],
                    "exactness": []}
    print(f"MPI: {report['mpi']}")
    if args.exactness:
        print("| fault (4 ranks) | runs | survivors finished | exact as the reference |")
        print("|---|---|---|---|")
        references: dict = {}
        for kind in args.kinds.split(","):
            runs = exactness_runs(kind, args.exactness, 30, args.timeout, references)
            report["exactness"] += runs
            print(f"| {kind} | {len(runs)} | {sum(r['ok'] for r in runs)} | "
                  f"{sum(r['exact'] for r in runs)} |", flush=True)
            for r in runs:
                if not r["exact"]:
                    print(f"  run not exact: status {r['status']}: {r['tail'][-400:]}")
    if not args.skip_recovery:
        print("| ranks | model | replacement | runs ok | kill -> next step on all (s) | "
              "survivors' recovery (s) | a step before the kill (s) | committed steps lost "
              "| steps re-run |")
        print("|---|---|---|---|---|---|---|---|---|")
        modes = [(rep == "yes", 0) for rep in args.replace.split(",") if rep] + \
            ([(False, args.spares)] if args.spares else [])
        cells = [(n, model, replace, spares) for replace, spares in modes
                 for n in [int(v) for v in args.ranks.split(",")]
                 for model in args.models.split(",")]
        for n, model, replace, spares in cells:
            runs = [recovery_run(n, model, args.steps, args.at, args.timeout, replace,
                                 spares) for _ in range(args.runs)]
            report["recovery"] += runs
            ok = [r for r in runs if r["ok"]]

            def span(k: str) -> str:
                return f"{min(r[k] for r in ok):.2f}-{max(r[k] for r in ok):.2f}" if ok else "-"

            how = f"warm spare ({spares})" if spares else "spawned" if replace else "none"
            print(f"| {n} | {model} | {how} | {len(ok)}/{len(runs)} "
                  f"| {span('kill_to_next_step_s')} "
                  f"| {span('recovery_s')} | {span('step_s')} | "
                  f"{sorted({r['committed_steps_lost'] for r in ok})} | "
                  f"{sorted({r['steps_rerun'] for r in ok})} |", flush=True)
            for r in runs:
                if not r["ok"]:
                    print(f"  failed run: status {r['status']}: {r['tail'][-400:]}")
    if args.spares and not args.skip_recovery:
        report["idle_spares"] = []
        print("\n| ranks | model | spares | trainers' step (s) | idle spare's CPU share |")
        print("|---|---|---|---|---|")
        for n in [int(v) for v in args.ranks.split(",")]:
            for model in args.models.split(","):
                r = idle_spare_run(n, model, args.steps, args.timeout, args.spares)
                report["idle_spares"].append(r)
                if r["ok"]:
                    print(f"| {n} | {model} | {args.spares} | {r['step_s']:.3f} | "
                          f"{100 * r['spare_cpu_share']:.1f}% of a core over "
                          f"{r['spare_wall_s']:.1f} s |", flush=True)
                else:
                    print(f"| {n} | {model} | failed: {r['status']} |\n{r['tail'][-600:]}")
    if not args.skip_overhead:
        print("\n| ranks | launch | blocking step (ms) | fault-tolerant step (ms) | ratio |")
        print("|---|---|---|---|---|")
        for per_rank in (True, False):
            r = overhead_run(4, per_rank, args)
            report["overhead"].append(r)
            if r["ok"]:
                print(f"| {r['ranks']} | {r['launch']} | {r['blocking_ms']:.1f} | "
                      f"{r['fault_tolerant_ms']:.1f} | {r['ratio']:.3f} |", flush=True)
            else:
                print(f"| 4 | {'per rank' if per_rank else 'mpiexec -n'} | failed: "
                      f"{r['status']} |\n{r['tail'][-600:]}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
