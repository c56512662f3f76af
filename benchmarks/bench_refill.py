"""A second death after the spare is used up: a refilled warm spare against a spawned
replacement (``commlib.elastic.run(spares=1, refill=True)`` against
``run(spares=1, replace=True)``).

    python benchmarks/bench_refill.py --ranks 4 --models 2MB,64MB --runs 3 \\
        --json benchmarks/results/refill_mpich.json

Each job: ``n`` trainers and one warm spare (``n + 1`` ranks, each a failure domain of its
own, as ``tests/elastic_common.py`` launches), ``tests/elastic_train_program.py`` (float64
MLP of about 2 MB or 64 MB, SGD with momentum, ``gradient_allreduce``, 25 MB buckets); the
last trainer SIGKILLed mid-backward of step ``--at`` (the spare joins), then trainer 1
mid-backward of step ``--second``; every rank sleeps ``--pause`` seconds after each step, so
that the deaths are seconds apart (as in a job whose deaths are minutes apart, the spawned
spare has started by the second one). Then:

* ``refill``: after the first joining, the trainers' next commit spawns a new spare (the
  trainers wait for its start up to its ``commlib.init()``: "refill stall"); at the second
  death that spare joins, with no process start;
* ``replace``: no refill; at the second death the pool is empty and the survivors spawn a
  replacement and send it the state.

Measured per job: seconds from each kill (the victim's clock) to the next step completed by
every trainer then alive (the joined spare or the replacement included; a step's time does
not include the pause), the refill's seconds on trainer 0 (``State.recoveries``), the
second spare's merge (its call to the state applied: long where it was still starting), the committed steps lost (the ledger: must be
0), and the job's seconds. Every job ends with ``n`` trainers; its parameters are those of
the tests' exact runs (``tests/test_elastic_spares.py`` checks them bit for bit).

The machine these figures come from is shared (2 cores): absolute times are not comparable
across runs; the two modes of one run, interleaved, are.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)

import _common as C  # noqa: E402

WIDTHS = {"2MB": 500, "64MB": 2890}  # float64 MLP 16-w-w-4: about w*w parameters


def job(n: int, model: str, mode: str, steps: int, at: int, second: int, pause: float,
        timeout: float) -> dict:
    """One job (see the module docstring); its measurements, or why it failed."""
    from elastic_common import TRAIN_PROGRAM, rank_hosts, results, run_job
    with tempfile.TemporaryDirectory(prefix="bench-refill-") as out:
        status, seconds, text, left = run_job(
            n + 1, [TRAIN_PROGRAM, out, "--steps", str(steps), "--fault", "kill",
                    "--victims", f"{n - 1},1", "--at", f"{at},{second}", "--width",
                    str(WIDTHS[model]), "--bucket-mb", "25", "--spares", "1",
                    "--pause", str(pause), f"--{mode}"], timeout, COMMLIB_TIMEOUT="120",
            ELASTIC_HOSTS=rank_hosts(n + 1))
        found = results(out)
        kills = []
        for victim in (n - 1, 1):
            path = os.path.join(out, f"fault{victim}.json")
            if os.path.exists(path):
                with open(path) as f:
                    kills.append(json.load(f)["time"])
    if len(found) != n or len(kills) != 2 or left:
        return {"ok": False, "mode": mode, "status": status, "tail": text[-1500:]}

    def back(kill: float, ranks: list[dict]) -> float:  # to the next step of them all
        return max(min(t for _, t in r["times"] if t > kill) for r in ranks) - kill
    # (at the first death: the trainers that were there before the second one)
    before = [r for r in found.values() if any(t < kills[1] for _, t in r["times"])]
    zero = found[0]
    ledger = zero["ledger"]
    lost = len({s for s, _ in ledger} ^ set(range(1, steps + 1))) + \
        (len(ledger) - len({s for s, _ in ledger}))
    refills = [x["seconds"] for x in zero["recoveries"] if "refilled" in x]
    merges = [x["seconds"] for x in zero["recoveries"] if x.get("joined")]
    times = [t for _, t in zero["times"] if t < kills[0]]
    return {"ok": True, "mode": mode, "ranks": n, "model": model,
            "first_death_s": back(kills[0], before), "second_death_s": back(kills[1],
                                                                            list(found.values())),
            "refill_s": refills, "merge_s": merges, "step_s": statistics.median(
                b - a for a, b in zip(times, times[1:])) - pause if len(times) > 2 else None,
            "committed_steps_lost": lost, "sizes": sorted({s for _, s in ledger}),
            "job_s": seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="4")
    p.add_argument("--models", default="2MB,64MB")
    p.add_argument("--runs", type=int, default=3, help="jobs per mode and cell")
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--at", type=int, default=6)
    p.add_argument("--second", type=int, default=30)
    p.add_argument("--pause", type=float, default=0.3,
                   help="seconds every rank sleeps after each step: deaths apart in time "
                        "(the refilled spare starts meanwhile)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json")
    args = p.parse_args(argv)
    from helpers import mpi_impl
    report: dict = {"mpi": mpi_impl().describe(), "runs": []}
    print(f"MPI: {report['mpi']}")
    print("| ranks | model | second death met by | runs ok | first death -> next step (s) "
          "| refill stall (s) | second death -> next step (s) | the second merge (s) | a step "
          "(s) | committed steps lost |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in [int(v) for v in args.ranks.split(",")]:
        for model in args.models.split(","):
            cell: dict[str, list[dict]] = {"refill": [], "replace": []}
            for _ in range(args.runs):  # the two modes interleaved
                for mode in cell:
                    r = job(n, model, mode, args.steps, args.at, args.second, args.pause,
                            args.timeout)
                    cell[mode].append(r)
                    report["runs"].append(r)
            for mode, runs in cell.items():
                ok = [r for r in runs if r["ok"]]

                def med(values: list[float]) -> str:
                    return (f"{statistics.median(values):.2f} ({min(values):.2f}-"
                            f"{max(values):.2f})") if values else "-"
                how = "the refilled spare" if mode == "refill" else "a spawned replacement"
                print(f"| {n} | {model} | {how} | {len(ok)}/{len(runs)} | "
                      f"{med([r['first_death_s'] for r in ok])} | "
                      f"{med([s for r in ok for s in r['refill_s']])} | "
                      f"{med([r['second_death_s'] for r in ok])} | "
                      f"{med([r['merge_s'][-1] for r in ok if len(r['merge_s']) > 1])} | "
                      f"{med([r['step_s'] for r in ok if r['step_s']])} | "
                      f"{sorted({r['committed_steps_lost'] for r in ok})} |", flush=True)
                for r in runs:
                    if not r["ok"]:
                        print(f"  failed run ({mode}): status {r['status']}: "
                              f"{r['tail'][-400:]}")
    if args.json:
        C.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
