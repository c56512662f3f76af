"""One ``mpiexec`` job of torch's own distributed suite: the tests of
``torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase`` run
one after the other on every rank in lockstep, over ``gloo`` or over ``commlib``.

    mpiexec -n N python tests/torch_suite_program.py BACKEND TIMEOUT_S NAME [NAME ...]

What torch's spawn harness (``TestDistBackend._run``) does for each test, done here per
rank with the rank from MPI: a fresh ``init_process_group`` (a new ``file://`` store,
torch's per-test ``timeout``), a barrier, the test method, a barrier,
``destroy_process_group``. The tests are told they run on gloo (``BACKEND=gloo``), so they
take gloo's code paths and skips; over commlib the ``init_process_group`` calls (the
harness's and the tests' own) get ``backend="commlib"`` instead, and ``commlib`` is put on
torch's profiler allowlists, so the profiler checks run for it as they run for gloo.

After each test the ranks agree over MPI (a communicator of this program's own, never the
backend under test) and rank 0 prints one line ``RESULT {json}``: the test, its outcome
(``passed``, ``skipped`` or ``failed``; a test failed if it failed on any rank), seconds,
and the first lines of each failing rank's error. After a failed test the job stops
(exit status 3), so one failure cannot poison the tests after it: the caller starts a new
job at the next test. A test that runs past ``TIMEOUT_S`` seconds on any rank ends the
whole job (``MPI_Abort``, status 4) after printing ``TIMEOUT {json}``.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import unittest

import commlib  # noqa: F401 - MPI up, RANK/WORLD_SIZE/MASTER_* set, backend registered

# isort: split
from mpi4py import MPI

HARNESS = MPI.COMM_WORLD.Dup()
RANK, SIZE = HARNESS.Get_rank(), HARNESS.Get_size()
SKIP_EXIT_CODES: set[int] = set()


def sync() -> None:
    """A barrier of the harness that sleeps while it waits (ranks outnumber cores here)."""
    req = HARNESS.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)


def setup_environment(backend: str) -> str:
    """The variables torch's suite reads at import; returns the shared temporary folder."""
    tmp = tempfile.mkdtemp(prefix="torch_suite_") if RANK == 0 else None
    tmp = HARNESS.bcast(tmp)
    if RANK == 0:
        for sub in ("barrier", "test_dir", "init_dir"):
            os.makedirs(os.path.join(tmp, sub), exist_ok=True)
    os.environ.update(BACKEND="gloo", WORLD_SIZE=str(SIZE), TEMP_DIR=tmp,
                      INIT_METHOD=f"file://{tmp}/init_dir/shared_init_file")
    sync()
    return tmp


def patch_torch(backend: str) -> None:
    """Over commlib: every default group the tests build is a commlib one, and commlib is
    on torch's profiler allowlists."""
    if backend == "gloo":
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed import distributed_test as dt
    init = dist.init_process_group

    def init_process_group(*args, **kwargs):
        if kwargs.get("backend") in ("gloo", dist.Backend.GLOO):
            kwargs["backend"] = backend
        return init(*args, **kwargs)

    dist.init_process_group = init_process_group
    for allowlist in (dt.PROFILING_SUPPORTED_BACKENDS, dt.CUDA_PROFILING_SUPPORTED_BACKENDS,
                      dt.SEND_RECV_PROFILING_SUPPORTED_BACKENDS):
        allowlist.append(backend)


def make_case_class():
    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.common_utils import TestCase
    from torch.testing._internal.distributed.distributed_test import DistributedTest
    SKIP_EXIT_CODES.update(s.exit_code for s in TEST_SKIPS.values())

    class Case(DistributedTest._DistTestBase, TestCase):
        """The suite's tests as methods of a plain TestCase, one process per rank."""

        @property
        def world_size(self) -> str:
            return os.environ["WORLD_SIZE"]

        @property
        def init_method(self) -> str:
            return f"file://{self.file_name}"

        def _barrier(self, *args, **kwargs) -> None:
            sync()

    return Case


def run_one(Case, name: str, index: int, tmp: str, backend: str) -> tuple[str, str]:
    """Run test ``name`` as torch's spawn harness does; (outcome, error text)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.testing._internal.distributed import distributed_test as dt
    case = Case(name)
    case.rank = RANK
    case.file_name = os.path.join(tmp, f"init_{index}")
    dt.INIT_METHOD = os.environ["INIT_METHOD"] = \
        f"file://{tmp}/init_dir/shared_init_file_{index}"
    if RANK == 0:
        for sub in ("barrier", "test_dir"):
            for f in os.listdir(os.path.join(tmp, sub)):
                os.unlink(os.path.join(tmp, sub, f))
    dt.Barrier.barrier_id = 0
    sync()
    try:
        timeout = timedelta(seconds=dt.CUSTOM_PG_TIMEOUT.get(name, dt.default_pg_timeout))
        dist.init_process_group(init_method=case.init_method, backend=backend,
                                world_size=SIZE, rank=RANK, timeout=timeout)
        case._barrier()
        case.setUp()
        try:
            getattr(case, name)()
        finally:
            case.tearDown()
        outcome, error = "passed", ""
    except unittest.SkipTest as exc:
        outcome, error = "skipped", str(exc)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        outcome = "skipped" if code in SKIP_EXIT_CODES else "failed"
        error = f"sys.exit({exc.code})"
    except BaseException:  # noqa: BLE001 - reported, then the job stops
        outcome, error = "failed", _without_repro(traceback.format_exc())
    if outcome != "failed":
        try:
            if dist.is_initialized():
                case._barrier()
                dist.destroy_process_group()
        except BaseException:  # noqa: BLE001
            outcome, error = "failed", "teardown: " + traceback.format_exc()
    return outcome, error


def _without_repro(text: str) -> str:
    """A traceback without the lines torch's TestCase appends on how to rerun the test."""
    keep = [line for line in text.splitlines()
            if "To execute this test" not in line and "PYTORCH_PRINT_REPRO" not in line
            and "torch_suite_program.py Case." not in line and line.strip()]
    return "\n".join(keep)


def arm_timeout(name: str, timeout_s: float) -> threading.Timer:
    def expire() -> None:
        sys.stdout.write("TIMEOUT " + json.dumps({"test": name, "rank": RANK,
                                                  "seconds": timeout_s}) + "\n")
        sys.stdout.flush()
        time.sleep(0.5)
        MPI.COMM_WORLD.Abort(4)
    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    return timer


def list_tests() -> list[str]:
    """Every test of ``_DistTestBase``, alphabetically."""
    from torch.testing._internal.distributed.distributed_test import DistributedTest
    return sorted(n for n in dir(DistributedTest._DistTestBase) if n.startswith("test_"))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--list"]:
        os.environ.setdefault("BACKEND", "gloo")
        os.environ.setdefault("WORLD_SIZE", str(SIZE))
        print("\n".join(list_tests()))
        return 0
    backend, timeout_s, names = argv[0], float(argv[1]), argv[2:]
    tmp = setup_environment(backend)
    t0 = time.monotonic()
    Case = make_case_class()
    patch_torch(backend)
    if RANK == 0:
        print("IMPORTED " + json.dumps({"seconds": round(time.monotonic() - t0, 1)}),
              flush=True)
    status = 0
    for index, name in enumerate(names):
        if RANK == 0:
            print("START " + json.dumps({"test": name}), flush=True)
        timer = arm_timeout(name, timeout_s)
        start = time.monotonic()
        outcome, error = run_one(Case, name, index, tmp, backend)
        seconds = time.monotonic() - start
        timer.cancel()
        seen = HARNESS.gather((outcome, error), root=0)
        outcomes = HARNESS.bcast(None if seen is None else [o for o, _ in seen])
        if RANK == 0:
            final = ("failed" if "failed" in outcomes else
                     "skipped" if "skipped" in outcomes else "passed")
            errors = {r: e.strip().splitlines()[-12:] for r, (o, e) in enumerate(seen)
                      if o == "failed"}
            reason = next((e for o, e in seen if o == "skipped"), "")
            print("RESULT " + json.dumps({"test": name, "outcome": final,
                                          "seconds": round(seconds, 2), "errors": errors,
                                          "reason": reason[:200]}), flush=True)
        if "failed" in outcomes:
            status = 3
            break
    sync()
    if RANK == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
