"""torch's own distributed suite over the commlib backend, against the same over gloo.

torch's ``DistributedTest._DistTestBase`` (the tests behind ``test_distributed_spawn.py``)
run under ``mpiexec`` by ``torch_suite_program.py`` (rank from MPI, every rank in lockstep,
a fresh process group per test, the tests told they run on gloo, commlib on torch's
profiler allowlists; see its docstring), once over gloo and once over commlib, at 2 and 3
ranks. A failing or hanging test ends its job; the next job starts at the test after it,
so one failure cannot poison the rest.

The test asserts that every test gloo passes also passes over commlib, except the
documented limitations in :data:`EXPECTED_FAILURES` (each with its reason), and that
those do fail (an expected failure that passes is reported, so the list stays true).

CI runs :data:`CI_TESTS`, a representative subset (every kind of collective, point-to-point,
groups, the group timeout, profiler checks, DDP with and without hooks, sparse
``all_reduce``), in the serial pass (``pytest --with-mpi tests/test_torch_suite.py``):
four jobs, two at a time, about 100 s on the loaded 2-core machine. The full list (285
tests, some 25 minutes there, mostly gloo's and commlib's per-test timeouts of the tests
that hang by design): ``TORCH_SUITE=full`` for the test, or as a script::

    python tests/test_torch_suite.py [--full] [--ranks 2 3] [--backends gloo commlib]
                                     [-k SUBSTRING] [--table FILE]

which prints the table (tests, passed over gloo, passed over commlib, skipped) and every
difference.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers import clean_env, run_mpi, serial_only  # noqa: E402

PROGRAM = os.path.join(os.path.dirname(__file__), "torch_suite_program.py")
SIZES = (2, 3)
BACKENDS = ("gloo", "commlib")
TEST_TIMEOUT_S = 90          # one test of torch's suite, on any rank
JOB_OVERHEAD_S = 60          # start-up of a job (imports) on a loaded machine

#: Tests gloo passes that fail over commlib by design: name -> the one-line reason.
EXPECTED_FAILURES: dict[str, str] = {
    "test_get_backend": "asserts dist.get_backend() == 'gloo'; the backend is named 'commlib'",
    "test_monitored_barrier_gloo": "torch's dist.monitored_barrier refuses every backend but "
                                   "gloo (commlib.torch_backend.monitored_barrier instead)",
    "test_monitored_barrier_gloo_rank_0_timeout": "torch's dist.monitored_barrier is gloo-only",
    "test_monitored_barrier_gloo_subgroup": "torch's dist.monitored_barrier is gloo-only",
    "test_monitored_barrier_allreduce_hang": "torch's dist.monitored_barrier is gloo-only",
    "test_monitored_barrier_allreduce_hang_wait_all_ranks":
        "torch's dist.monitored_barrier is gloo-only",
    "test_monitored_barrier_failure_order": "torch's dist.monitored_barrier is gloo-only",
    "test_monitored_barrier_wait_all_ranks": "torch's dist.monitored_barrier is gloo-only",
}

#: The subset run in CI: every kind of collective (blocking, async, complex, coalesced,
#: full groups, sub-groups), point-to-point, the group timeout, sparse all_reduce, the
#: profiler checks of collectives and point-to-point, objects, DDP with and without hooks,
#: and one expected failure (so the list is checked too).
CI_TESTS = [
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_sum_complex",
    "test_all_reduce_full_group_max", "test_all_reduce_coalesced_sum", "test_broadcast",
    "test_reduce_sum", "test_all_gather", "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_with_empty", "test_gather", "test_scatter",
    "test_all_to_all_single_unequal_split", "test_barrier", "test_barrier_timeout_full_group",
    "test_barrier_timeout_global", "test_sparse_all_reduce_sum",
    "test_send_recv_autograd_profiler", "test_send_recv_any_source_torch_profiler",
    "test_isend_torch_profiler", "test_batch_isend_irecv_gloo", "test_destroy_group",
    "test_all_gather_object_subgroup", "test_DistributedDataParallelCPU",
    "test_accumulate_gradients_no_sync_allreduce_hook", "test_get_backend",
]


@dataclass
class Run:
    """One backend at one world size: test name -> outcome (``passed``, ``skipped``,
    ``failed``) and the failures' output."""
    backend: str
    ranks: int
    outcomes: dict[str, str] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)
    durations: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    jobs: int = 0


def list_tests() -> list[str]:
    out = subprocess.run([sys.executable, PROGRAM, "--list"], env=clean_env(),
                         capture_output=True, text=True, timeout=600, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.startswith("test_")]


def _records(out: str, kind: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(rf"^{kind} (\{{.*\}})$", out, re.M)]


def run_suite(backend: str, ranks: int, names: list[str]) -> Run:
    """All of ``names`` over ``backend`` at ``ranks`` ranks: jobs until each test has an
    outcome (a job ends at a failing test; the next starts after it)."""
    run = Run(backend, ranks)
    start = time.monotonic()
    left = list(names)
    while left:
        run.jobs += 1
        limit = JOB_OVERHEAD_S + TEST_TIMEOUT_S * (len(left) + 1)
        status, _, out = run_mpi(ranks, [PROGRAM, backend, str(TEST_TIMEOUT_S)] + left,
                                 timeout=limit, OMP_NUM_THREADS="1",
                                 COMMLIB_TIMEOUT=str(3 * TEST_TIMEOUT_S))
        for rec in _records(out, "RESULT"):
            run.outcomes[rec["test"]] = rec["outcome"]
            run.durations[rec["test"]] = rec["seconds"]
            if rec["outcome"] == "failed":
                run.details[rec["test"]] = "\n".join(
                    f"rank {r}: " + "\n  ".join(lines) for r, lines in rec["errors"].items())
        started = [rec["test"] for rec in _records(out, "START")]
        unfinished = [t for t in started if t not in run.outcomes]
        for name in unfinished:       # a hang (TIMEOUT) or a crash of the job
            run.outcomes[name] = "failed"
            why = "timeout" if _records(out, "TIMEOUT") else f"job ended with status {status}"
            run.details[name] = f"{why}; output tail:\n{out[-2500:]}"
        done = [t for t in left if t in run.outcomes]
        if not done:                  # the job died before its first test
            for name in left:
                run.outcomes[name] = "failed"
                run.details[name] = f"job start failed, status {status}:\n{out[-2500:]}"
            break
        left = left[left.index(done[-1]) + 1:]
    run.seconds = time.monotonic() - start
    return run


def run_all(names: list[str], sizes=SIZES, backends=BACKENDS, jobs: int = 2) -> list[Run]:
    """Every (backend, size) pair; ``jobs`` pairs at a time (a job's ranks mostly wait)."""
    pairs = [(b, n) for n in sizes for b in backends]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda p: run_suite(p[0], p[1], names), pairs))


def compare(runs: list[Run]) -> tuple[str, list[str]]:
    """The table (per world size: tests, passed over gloo, passed over commlib, skipped)
    and the problems: tests gloo passes that commlib fails (not expected), expected
    failures that pass."""
    lines = ["| ranks | tests | passed over gloo | passed over commlib | skipped | "
             "failed over gloo | expected failures over commlib | seconds gloo / commlib |",
             "|---|---|---|---|---|---|---|---|"]
    problems = []
    for n in sorted({r.ranks for r in runs}):
        gloo = next(r for r in runs if r.ranks == n and r.backend == "gloo")
        ours = next(r for r in runs if r.ranks == n and r.backend == "commlib")
        names = sorted(gloo.outcomes)
        passed_gloo = [t for t in names if gloo.outcomes[t] == "passed"]
        passed_ours = [t for t in names if ours.outcomes.get(t) == "passed"]
        skipped = [t for t in names if gloo.outcomes[t] == "skipped"]
        expected = [t for t in passed_gloo if t in EXPECTED_FAILURES]
        failed_gloo = [t for t in names if gloo.outcomes[t] == "failed"]
        lines.append(f"| {n} | {len(names)} | {len(passed_gloo)} | {len(passed_ours)} | "
                     f"{len(skipped)} | {len(failed_gloo)} | {len(expected)} | "
                     f"{gloo.seconds:.0f} / {ours.seconds:.0f} |")
        for t in passed_gloo:
            got = ours.outcomes.get(t)
            if t in EXPECTED_FAILURES:
                if got == "passed":
                    problems.append(f"x{n} {t}: listed as an expected failure "
                                    f"({EXPECTED_FAILURES[t]}) but passes over commlib")
            elif got != "passed":
                problems.append(f"x{n} {t}: passes over gloo, {got} over commlib\n"
                                f"{ours.details.get(t, '')}")
        for t in names:
            if gloo.outcomes[t] == "skipped" and ours.outcomes.get(t) == "failed":
                problems.append(f"x{n} {t}: skipped over gloo, failed over commlib\n"
                                f"{ours.details.get(t, '')}")
    return "\n".join(lines), problems


@serial_only
@pytest.mark.timeout(1800)
def test_torch_distributed_suite_over_commlib_matches_gloo(request):
    names = list_tests() if os.environ.get("TORCH_SUITE") == "full" else CI_TESTS
    runs = run_all(names)
    text, problems = compare(runs)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    (reporter.write_line if reporter is not None else print)("\n" + text)
    assert not problems, "\n\n".join(problems)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="every test of the suite")
    parser.add_argument("--ranks", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS))
    parser.add_argument("-k", default="", help="only tests whose name contains this")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--table", help="also write the table and problems to this file")
    args = parser.parse_args(argv)
    names = list_tests() if args.full else CI_TESTS
    names = [t for t in names if args.k in t]
    runs = run_all(names, args.ranks, args.backends, args.jobs)
    for run in runs:
        print(f"{run.backend} x{run.ranks}: {run.seconds:.0f} s, {run.jobs} job(s): "
              + json.dumps({o: sum(v == o for v in run.outcomes.values())
                            for o in ("passed", "skipped", "failed")}))
        for t, d in sorted(run.details.items()):
            print(f"  FAILED {t}: {d.splitlines()[-1] if d else ''}")
    problems: list[str] = []
    text = ""
    if set(args.backends) == set(BACKENDS):
        text, problems = compare(runs)
        print(text)
        print("\n\n".join(problems))
    if args.table:
        with open(args.table, "w") as f:
            json.dump({"table": text, "problems": problems,
                       "runs": [r.__dict__ for r in runs]}, f, indent=1)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
