"""The store's host killed in the store-backed world (issue 34): repeated runs of the SIGKILL
of rank 0 (it hosts the job's TCPStore; a standby store on rank 1 takes over,
:mod:`commlib.mpi.launch.standby`), each checked exactly against the reference, and the
standby's steady-state cost per step.

    python benchmarks/bench_store_failover.py [--runs 20] [--ranks 3] [--victims 0 --at 12]
        [--pause 0] [--cost-runs 3] [--lock /tmp/commlib-bench.lock] [--json out.json]

Each run is ``tests/elastic_train_program.py`` (float64 MLP, SGD with momentum, 30 steps
through ``commlib.elastic``) started as ``--ranks`` processes with ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` and ``COMMLIB_FAULT_TOLERANT=1``, the victims SIGKILLed mid-
backward at the given steps (``tests/elastic_common.run_store_job``, outer timeout 150 s). A
run passes when the victims died (-9), every other rank exited 0 after all 30 steps, its
parameters equal bit for bit the ``mpiexec`` reference that shrinks at the agreed steps
(``elastic_common.reference``, one per distinct agreement), nothing was left running or in
``/dev/shm``. Reported: passes, kill to the survivors' next step (the latest survivor's first
step committed after the victim's kill), the job's seconds. ``--cost-runs K``: K pairs of
failure-free 200-step runs with the standby on and off (``COMMLIB_STORE_STANDBY``), the
median step of each (the slowest rank's, from the program's step times). ``--lock``: each job
takes the file lock (``flock``) for its own run only.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(os.path.dirname(HERE), "tests")]
import numpy as np  # noqa: E402

from elastic_common import (  # noqa: E402
    TRAIN_PROGRAM,
    leftover_shm,
    params,
    reference,
    reference_args,
    results,
    run_store_job,
)


class _Dirs:
    """The ``mktemp`` of pytest's ``tmp_path_factory``, for ``elastic_common.reference``."""

    def __init__(self, root: str) -> None:
        self.root = root

    def mktemp(self, name: str) -> pathlib.Path:
        return pathlib.Path(tempfile.mkdtemp(prefix=name, dir=self.root))


class _Locked:
    def __init__(self, path: str | None) -> None:
        self.path, self.f = path, None

    def __enter__(self) -> None:
        if self.path:
            self.f = open(self.path, "a")
            fcntl.flock(self.f, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self.f is not None:
            fcntl.flock(self.f, fcntl.LOCK_UN)
            self.f.close()


def one_run(args: argparse.Namespace, dirs: _Dirs) -> dict:
    out = dirs.mktemp("run")
    dead = [int(v) for v in args.victims.split(",")]
    argv = [TRAIN_PROGRAM, str(out), "--fault", "kill", "--victims", args.victims,
            "--at", args.at] + (["--pause", str(args.pause)] if args.pause else [])
    with _Locked(args.lock):
        load = os.getloadavg()[0]
        codes, seconds, text, left = run_store_job(args.ranks, argv, 150,
                                                   COMMLIB_TIMEOUT="60")
    rec: dict = {"codes": codes, "seconds": round(seconds, 2), "load": load,
                 "left": left, "ok": False}
    found = results(str(out))
    want = [-9 if r in dead else 0 for r in range(args.ranks)]
    if codes != want or left or sorted(found) != [r for r in range(args.ranks)
                                                  if r not in dead]:
        rec["why"] = "statuses/results"
        rec["tail"] = text[-1500:]
        return rec
    victims, steps = reference_args(found)
    rec["agreed"] = steps
    with _Locked(args.lock):
        ref = reference(dirs, "gradient_allreduce", victims, steps, n=args.ranks)
    exact = all(np.array_equal(params(found[r]), params(ref[r])) and
                found[r]["ledger"] == ref[r]["ledger"] for r in found)
    gaps = []
    for r in dead:
        with open(out / f"fault{r}.json") as f:
            killed = json.load(f)["time"]
        gaps.append(max(min(t for _, t in d["times"] if t > killed)
                        for d in found.values()) - killed)
    rec.update(ok=exact and not leftover_shm(str(out)), exact=exact,
               kill_to_next_step_s=[round(g, 4) for g in gaps])
    return rec


def step_cost(args: argparse.Namespace, dirs: _Dirs, standby: str) -> float:
    out = dirs.mktemp(f"cost{standby}")
    with _Locked(args.lock):
        codes, _, text, left = run_store_job(
            args.ranks, [TRAIN_PROGRAM, str(out), "--steps", "200"], 150,
            COMMLIB_TIMEOUT="60", COMMLIB_STORE_STANDBY=standby)
    assert codes == [0] * args.ranks and not left, (codes, text[-2000:])
    found = results(str(out))
    times = [[t for _, t in d["times"]] for d in found.values()]
    # the slowest rank's step: per step, the latest rank's commit minus the previous one
    latest = [max(ts) for ts in zip(*times)]
    return statistics.median(b - a for a, b in zip(latest[20:], latest[21:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--victims", default="0")
    ap.add_argument("--at", default="12")
    ap.add_argument("--pause", type=float, default=0.0)
    ap.add_argument("--cost-runs", type=int, default=0)
    ap.add_argument("--lock", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dirs = _Dirs(tempfile.mkdtemp(prefix="bench_store_failover"))
    runs: list[dict] = []
    cost = []
    for _ in range(args.cost_runs):
        cost.append({"on": step_cost(args, dirs, "1"), "off": step_cost(args, dirs, "0")})
        print(f"median step: standby on {cost[-1]['on'] * 1e3:.2f} ms, off "
              f"{cost[-1]['off'] * 1e3:.2f} ms", flush=True)
        if args.json:
            write(args, runs, cost)
    for i in range(args.runs):
        rec = one_run(args, dirs)
        runs.append(rec)
        print(f"run {i + 1}: {'ok' if rec['ok'] else 'FAILED'} codes {rec['codes']} "
              f"kill->next step {rec.get('kill_to_next_step_s')} s, agreed "
              f"{rec.get('agreed')}, {rec['seconds']} s, load {rec['load']:.1f}"
              + ("" if rec["ok"] else f"\n{rec.get('tail', '')}"), flush=True)
        if args.json:  # after every run: a partial series is kept if stopped
            write(args, runs, cost)
    write(args, runs, cost)


def write(args: argparse.Namespace, runs: list[dict], cost: list[dict]) -> None:
    """The summary (printed) and every run (``--json``)."""
    gaps = [g for r in runs for g in r.get("kill_to_next_step_s", [])]
    summary = {"runs": len(runs), "passed": sum(r["ok"] for r in runs),
               "ranks": args.ranks, "victims": args.victims, "at": args.at,
               "kill_to_next_step_s": {"min": min(gaps), "median": statistics.median(gaps),
                                       "max": max(gaps)} if gaps else None,
               "step_cost": cost, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if cost or len(runs) == args.runs:
        print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
