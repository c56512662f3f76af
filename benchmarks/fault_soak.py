"""Soak of elastic training's exactness under faults (issue 34): ``--runs N`` fresh jobs
per fault kind and algorithm, each checked bit for bit, with pass/fail counts and
kill-to-next-step times.

    python benchmarks/fault_soak.py --runs 20 --json benchmarks/results/fault_soak_mpich.json \\
        --lock /tmp/commlib-bench.lock --until 14:40
    python benchmarks/fault_soak.py --table benchmarks/results/fault_soak_*.json

Each run is a job of ``tests/elastic_train_program.py`` (float64 MLP, SGD with momentum or
the algorithm's optimizer, 30 steps, the global batch of 24 split over the trainers)
launched by ``tests/elastic_common.run_job`` on the MPI library of the Python that runs
this script (each rank a failure domain of its own, the launcher keeping the survivors
running; an outer timeout, the whole job killed past it), one fault per job:

* ``kill-rank0``, ``kill-middle``, ``kill-last``: 4 ranks, rank 0, 1 or 3 SIGKILLed in the
  middle of the backward of step 12 (some gradient buckets on their way);
  ``forward-middle``: rank 1 SIGKILLed in the middle of the forward (``killfwd``);
  ``commit-middle``: rank 1 SIGKILLed inside ``State.commit`` (``killcommit``: its
  optimizer step applied, the commit not recorded). Passed: every survivor finishes all 30
  steps, every step applied exactly once (the ledger), parameters, ledger and learning rate
  bit for bit those of the reference run (no fault tolerance, no failure) in which the
  victim leaves after the step the survivors agreed on (one reference job per distinct
  agreement, cached).
* ``spare-rank0``, ``spare-last``: 3 trainers and 1 warm spare (``run(spares=1)``), trainer
  0 or 2 SIGKILLed mid-backward of step 12; the spare joins. Passed: the trainers (the
  spare among them) finish, every step applied by a group of 3, parameters bit for bit
  those of the 3-rank run without any failure (``gradient_allreduce`` only: what a spare
  receives is defined for replicated state). ``spare-joining-survivor``: 3 trainers and 2
  spares; trainer 2 killed at step 12, then survivor 1 SIGKILLs itself while spare 3 joins
  (the merged group built, rank 0 sending the state: ``test_a_survivor_dies_while_a_spare_
  joins[1]``); trainers 0, 3 and 4 must finish, exact as above.
* ``replace-replacement``, ``replace-joining``, ``replace-survivor-sending``: 3 ranks,
  ``run(replace=True)``, no spare: rank 2 SIGKILLed mid-backward of step 12 and a
  replacement spawned on its host; then that replacement SIGKILLed mid-backward of step 20,
  or at its joining (the grown world built, before the state: ``assembled``), or survivor 1
  about to send it the state (``test_elastic_spares.py``); another replacement is spawned.
  Passed: three ranks finish, exact against the 3-rank run without failure, as above
  (``gradient_allreduce`` only).
* ``refill-second``: 3 trainers and 1 spare with ``run(spares=1, refill=True)``: trainer 2
  SIGKILLed at step 12 (the spare joins, a new one is spawned at the next commit), then
  trainer 1 at step 20 (the refilled spare joins). Passed as the spare kinds.

Algorithms (``--algorithms``): ``gradient_allreduce`` and the relaxed ones ``commlib.elastic``
supports (``decentralized``, ``local_sgd``, ``diloco``, ``streaming_diloco``, ``powersgd``,
``low_precision_decentralized``, ``qadam``, ``sparseloco``, ``muloco``, ``demo``), with the
settings of ``tests/test_elastic.py``; ``local_sgd`` and ``diloco`` are killed at step 14
(mid-round: the partial round is discarded).

A run also fails on a hang (the outer timeout), a process of the job left alive, a
shared-memory segment left in ``/dev/shm``, or (MPICH) a job status other than the killed
rank's (9, or 255: hydra's "unable to send SIGUSR1 downstream"): a survivor that
segfaults fails the run even where the others finish. Measured per run: seconds from the
kill (the victim's clock, the same host) to the next step completed by every trainer
(max over trainers: with a spare, the spare's first step after its joining), the agreed
step, the job's seconds and the load average; every failed run keeps the job's whole
output in the JSON (``log``).

Negative control: ``--program-args --skip-spare-state`` (the joining spare keeps its own
model) or ``--skip-agreement`` (each survivor restores its own last commit) must make the
runs fail the comparison.

Machine etiquette (``--lock PATH``): each job, reference jobs included, takes the lock
alone and releases it (``--gap`` seconds between jobs, so that others waiting get it);
``--until HH:MM`` (UTC) stops before a job that would start later. Runs are interleaved
(one per case in turn), so a stopped soak has about as many runs of each case; the JSON is
rewritten after every run and read back at the start (a soak resumes where it stopped).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import glob
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

STEPS = 30
AT = 12
#: Algorithms whose death is placed mid-round (their commit is the last average).
SYNCED_AT = {"local_sgd": 14, "diloco": 14}
#: Fault kinds: ranks launched, warm spares, the fault and its victim, more program
#: arguments, the ranks that must finish.
KINDS = {
    "kill-rank0": dict(n=4, spares=0, fault="kill", victim=0),
    "kill-middle": dict(n=4, spares=0, fault="kill", victim=1),
    "kill-last": dict(n=4, spares=0, fault="kill", victim=3),
    "forward-middle": dict(n=4, spares=0, fault="killfwd", victim=1),
    "commit-middle": dict(n=4, spares=0, fault="killcommit", victim=1),
    "spare-rank0": dict(n=4, spares=1, fault="kill", victim=0),
    "spare-last": dict(n=4, spares=1, fault="kill", victim=2),
    # test_a_survivor_dies_while_a_spare_joins[1]: trainer 2 killed, then survivor 1 while
    # spare 3 joins; spare 4 joins too
    "spare-joining-survivor": dict(n=5, spares=2, fault="kill", victim=2,
                                   extra=["--join-victim", "1", "--join-death", "sending"],
                                   trainers=[0, 3, 4]),
    # replace=True, no spare (test_elastic_spares.py): trainer 2 killed at step 12, a
    # replacement spawned on its host; then that replacement SIGKILLed mid-backward of
    # step 20, or at its joining (the grown world built, before the state), or survivor 1
    # about to send it the state; a second replacement is spawned: back at 3
    "replace-replacement": dict(n=3, spares=0, fault="kill", victim=2, replace=True,
                                extra=["--replace", "--replacement-dies-at", "20"],
                                trainers=[0, 1, 2]),
    "replace-joining": dict(n=3, spares=0, fault="kill", victim=2, replace=True,
                            extra=["--replace", "--replacement-join-death", "assembled"],
                            trainers=[0, 1, 2]),
    "replace-survivor-sending": dict(n=3, spares=0, fault="kill", victim=2, replace=True,
                                     extra=["--replace", "--join-victim", "1",
                                            "--join-death", "sending"],
                                     trainers=[0, 1, 2]),
    # run(spares=1, refill=True) (test_the_pool_is_refilled_after_a_spare_joined):
    # trainer 2 killed at step 12, the spare joins, a new spare is spawned at the next
    # commit; trainer 1 killed at step 20: the refilled spare joins (the first spawned
    # process, named 1 at the end); back at 3
    "refill-second": dict(n=4, spares=1, fault="kill", victim=2, replace=True,
                          extra=["--refill", "--victims", "2,1", "--at", "12,20"],
                          trainers=[0, 1, 3]),
}
ALGORITHMS = ["gradient_allreduce", "decentralized", "local_sgd", "diloco",
              "streaming_diloco", "powersgd", "low_precision_decentralized", "qadam",
              "sparseloco", "muloco", "demo"]
#: The job's status where the implementation says (MPICH: the killed rank's signal).
KILLED = {"mpich": (9, 255)}
OUTER_S = 150


@contextlib.contextmanager
def locked(path: str | None):
    """Hold ``path``'s exclusive lock (flock) for one job."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.references: dict[tuple, dict[int, dict]] = {}
        self.last_job = 0.0

    def job(self, n: int, argv: list[str], keep_running: bool = True, **env: str):
        """One job under the lock, ``--gap`` seconds after the last one ended."""
        from elastic_common import run_job
        wait = self.args.gap - (time.monotonic() - self.last_job)
        if wait > 0:
            time.sleep(wait)
        with locked(self.args.lock):
            load = os.getloadavg()[0]
            status, seconds, text, left = run_job(
                n, [os.path.join(ROOT, "tests", "elastic_train_program.py")] + argv,
                OUTER_S, keep_running=keep_running, COMMLIB_TIMEOUT="60",
                PYTHONFAULTHANDLER="1", **env)
        self.last_job = time.monotonic()
        return status, seconds, text, left, load

    def reference(self, algorithm: str, victims: str, steps: str, n: int) -> dict[int, dict]:
        """The ``n``-rank run without fault tolerance in which ``victims`` leave after the
        committed ``steps`` (none: the run without failure); cached."""
        from elastic_common import results
        key = (algorithm, victims, steps, n)
        if key not in self.references:
            with tempfile.TemporaryDirectory(prefix="soak-ref-") as out:
                scenario = [{"name": "s", "algorithm": algorithm, "victims": victims,
                             "steps": steps}]
                status, _, text, left, _ = self.job(
                    n, [out, "--steps", str(STEPS), "--scenarios", json.dumps(scenario)],
                    keep_running=False)
                found = results(os.path.join(out, "s"))
            if status != 0 or left:
                raise RuntimeError(f"reference {key} failed ({status})\n{text[-3000:]}")
            self.references[key] = found
        return self.references[key]

    def run(self, kind: str, algorithm: str) -> dict:
        from elastic_common import leftover_shm, rank_hosts, results
        from helpers import mpi_impl
        spec = KINDS[kind]
        n, spares, fault, victim = spec["n"], spec["spares"], spec["fault"], spec["victim"]
        at = SYNCED_AT.get(algorithm, AT)
        with tempfile.TemporaryDirectory(prefix="soak-") as out:
            here = os.getcwd()
            os.chdir(out)  # (the ranks' working directory: where a core dump goes)
            try:
                status, seconds, text, left, load = self.job(
                    n, [out, "--steps", str(STEPS), "--algorithm", algorithm, "--fault",
                        fault, "--victims", str(victim), "--at", str(at), "--spares",
                        str(spares), *spec.get("extra", []), *self.args.program_args.split()],
                    **({"ELASTIC_HOSTS": rank_hosts(n)} if spec.get("replace") else {}))
            finally:
                os.chdir(here)
            cores = keep_cores(out, self.args.cores, f"{kind}-{algorithm}")
            found = results(out)
            shm = leftover_shm(out)
            killed = None
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(out, f"fault{victim}.json")) as f:
                    killed = json.load(f)["time"]
        # (with a spare: it is rank n - 1)
        trainers = spec.get("trainers") or [r for r in range(n) if r != victim]
        record = {"kind": kind, "algorithm": algorithm, "status": status,
                  "job_s": round(seconds, 2), "load": round(load, 2),
                  "finished": sorted(found), "left": left, "shm": shm, "cores": cores,
                  "time": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds")}
        # communicator creations given up after create_limit() and built again (a hang
        # inside the MPI library with every member alive; counted per rank that printed it)
        record["creation_retries"] = text.count("building it again under a new name")
        why = []
        if status == -9:
            why.append(f"hang: killed after {OUTER_S} s")
        ok_status = KILLED.get(mpi_impl().key)
        if ok_status is not None and status not in ok_status:
            why.append(f"job status {status}, expected one of {ok_status}")
        if left:
            why.append(f"processes {left} left running")
        if shm:
            why.append(f"left {shm} in /dev/shm")
        if cores:
            why.append(f"core dumps {cores}")
        if sorted(found) != trainers:
            why.append(f"ranks {sorted(found)} finished, expected {trainers}")
        elif any(r["step"] != STEPS or [s for s, _ in r["ledger"]] !=
                 list(range(1, STEPS + 1)) for r in found.values()):
            why.append("committed steps lost or doubled: " +
                       str({k: [s for s, _ in r["ledger"]] for k, r in found.items()}))
        else:
            first = found[trainers[0]]
            record["agreed"] = first["recoveries"][0]["step"] if first["recoveries"] else None
            try:
                why += self.compare(found, spares or bool(spec.get("replace")), algorithm, n)
            except RuntimeError as exc:
                why.append(str(exc))
            if killed is not None:
                record["kill_to_next_step_s"] = round(max(
                    min((t for _, t in r["times"] if t > killed), default=float("inf"))
                    for r in found.values()) - killed, 4)
        record["passed"] = not why
        if why:
            record["why"] = why
            record["log"] = text
        return record

    def compare(self, found: dict[int, dict], spares: int, algorithm: str,
                n: int) -> list[str]:
        """Differences from the reference (none: exact)."""
        import numpy as np

        from elastic_common import params, reference_args
        if spares:  # back at n - spares trainers (or n: replaced): the run without failure
            ref = self.reference(algorithm, "", "", len(found))
            pairs = [(rank, ref[0]) for rank in found]
        else:
            victims, steps = reference_args(found)
            ref = self.reference(algorithm, victims, steps, n)
            pairs = [(rank, ref.get(rank)) for rank in found]
        why = []
        for rank, theirs in pairs:
            mine = found[rank]
            if theirs is None:
                why.append(f"rank {rank}: no reference")
                continue
            a, b = params(mine), params(theirs)
            if not np.array_equal(a, b):
                why.append(f"rank {rank}: parameters differ from the reference in "
                           f"{int((a != b).sum())} of {a.size} entries, by up to "
                           f"{float(np.abs(a - b).max()):.3g}")
            if mine["ledger"] != theirs["ledger"]:
                why.append(f"rank {rank}: ledger {mine['ledger']} != {theirs['ledger']}")
            if not spares and mine["lr"] != theirs["lr"]:
                why.append(f"rank {rank}: lr {mine['lr']} != {theirs['lr']}")
        return why


def keep_cores(out: str, keep: str | None, name: str) -> list[str]:
    """Move the core dumps a job left in ``out`` to a new folder under ``keep`` (None:
    delete them); their new paths."""
    import shutil
    found = glob.glob(os.path.join(out, "core*"))
    if not found or not keep:
        for path in found:
            os.unlink(path)
        return found and ["(deleted) " + os.path.basename(p) for p in found]
    dest = tempfile.mkdtemp(prefix=name + "-", dir=keep)
    kept = []
    for path in found:
        shutil.move(path, dest)
        kept.append(os.path.join(dest, os.path.basename(path)))
    return kept


def cases(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(kind, algorithm) pairs; a spare kind only with gradient_allreduce."""
    out = []
    for algorithm in args.algorithms.split(","):
        for kind in args.kinds.split(","):
            if kind not in KINDS:
                raise SystemExit(f"unknown kind {kind!r} (known: {', '.join(KINDS)})")
            if ((KINDS[kind]["spares"] or KINDS[kind].get("replace"))
                    and algorithm != "gradient_allreduce"):
                continue
            out.append((kind, algorithm))
    return out


def deadline(until: str | None,
             now: datetime.datetime | None = None) -> datetime.datetime | None:
    """The first ``HH:MM`` (UTC) after ``now`` (default: the present): tomorrow's where
    today's has passed, so that a soak started at 23:00 with ``--until 01:30`` runs past
    midnight."""
    if not until:
        return None
    now = now or datetime.datetime.now(datetime.timezone.utc)
    hh, mm = (int(x) for x in until.split(":"))
    at = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
    return at if at > now else at + datetime.timedelta(days=1)


def past(end: datetime.datetime | None) -> bool:
    return end is not None and datetime.datetime.now(datetime.timezone.utc) >= end


def soak(args: argparse.Namespace) -> int:
    from helpers import mpi_impl
    report = {"mpi": mpi_impl().describe(), "mpi_key": mpi_impl().key, "steps": STEPS,
              "runs": []}
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            report = json.load(f)
    print(f"MPI: {report['mpi']}", flush=True)
    todo = cases(args)
    s = Soak(args)
    end = deadline(args.until)

    def count(case: tuple[str, str]) -> int:
        return sum((r["kind"], r["algorithm"]) == case for r in report["runs"])

    while True:
        pending = [c for c in todo if count(c) < args.runs]
        if not pending:
            break
        for case in pending:
            if past(end):
                print(f"stopped: past {args.until} UTC", flush=True)
                return 0
            record = s.run(*case)
            report["runs"].append(record)
            print(f"{record['time']} {case[0]} {case[1]} #{count(case)}: "
                  f"{'passed' if record['passed'] else 'FAILED'} status {record['status']} "
                  f"kill->next {record.get('kill_to_next_step_s')} s, job "
                  f"{record['job_s']} s, load {record['load']}"
                  + ("" if record["passed"] else f"\n  {record['why']}"), flush=True)
            if args.json:
                os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                tmp = args.json + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(report, f, indent=1)
                os.replace(tmp, args.json)
    return 0


def table(paths: list[str]) -> str:
    """The markdown table of the soak files: kind x algorithm x runtime (the runs of one
    case in several files counted together)."""
    seen: dict[tuple[str, str, str], list[dict]] = {}
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        mpi = report["mpi"].split(" (")[0]
        for r in report["runs"]:
            seen.setdefault((r["kind"], r["algorithm"], mpi), []).append(r)
    lines = ["| fault kind | algorithm | MPI | runs | passed | kill -> next step (s), "
             "median (range) | load |", "|---|---|---|---|---|---|---|"]
    order = {k: i for i, k in enumerate(KINDS)}
    for (kind, algorithm, mpi), runs in sorted(
            seen.items(), key=lambda kv: (kv[0][2], ALGORITHMS.index(kv[0][1]),
                                          order[kv[0][0]])):
        times = [r["kill_to_next_step_s"] for r in runs if "kill_to_next_step_s" in r]
        loads = [r["load"] for r in runs]
        span = (f"{statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f})"
                if times else "-")
        lines.append(f"| {kind} | {algorithm} | {mpi} | {len(runs)} | "
                     f"{sum(r['passed'] for r in runs)} | {span} | "
                     f"{min(loads):.1f}-{max(loads):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20, help="runs per case")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--algorithms", default="gradient_allreduce")
    p.add_argument("--json", help="results (read back and extended when it exists)")
    p.add_argument("--lock", help="a lock file each job holds alone (flock)")
    p.add_argument("--gap", type=float, default=2.0, help="seconds between two jobs")
    p.add_argument("--until", help="HH:MM (UTC): start no job after it")
    p.add_argument("--program-args", default="",
                   help="more arguments of every faulty job (negative controls: "
                        "--skip-agreement, --skip-spare-state)")
    p.add_argument("--cores", metavar="DIR",
                   help="enable core dumps (RLIMIT_CORE; the ranks' working directory is "
                        "the job's folder) and keep each job's under DIR")
    p.add_argument("--table", nargs="+", metavar="JSON", help="print the table and exit")
    args = p.parse_args(argv)
    if args.table:
        print(table(sorted({p for pattern in args.table for p in glob.glob(pattern)})))
        return 0
    if args.cores:
        import resource
        os.makedirs(args.cores, exist_ok=True)
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY,) * 2)
    return soak(args)


if __name__ == "__main__":
    sys.exit(main())
