"""The main job runs end to end under mpiexec and learns."""
import re

import pytest

from helpers import require, run_mpi, serial_only

pytest.importorskip("torch")
require("sklearn")
pytestmark = serial_only


def test_train_digits_on_two_ranks():
    code, seconds, out = run_mpi(2, ["-m", "commlib.examples.train_digits", "--epochs", "3",
                                     "--no-progress"], timeout=240, COMMLIB_TIMEOUT="60")
    assert code == 0, out
    assert out.count("epoch ") == 3 and "samples/s" in out
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", out).group(1))
    assert accuracy > 0.85, out


def test_selftest_passes_on_three_ranks():
    code, seconds, out = run_mpi(3, ["-m", "commlib.tools.selftest", "--size-mb", "0.25",
                                     "--reps", "2"], timeout=120, COMMLIB_TIMEOUT="60")
    assert code == 0 and "self-test PASSED" in out, out


def test_train_digits_with_sync_bn_and_a_timeline(tmp_path):
    import json
    trace = str(tmp_path / "digits")
    code, seconds, out = run_mpi(2, ["-m", "commlib.examples.train_digits", "--epochs", "1",
                                     "--no-progress", "--sync-bn", "--timeline", trace],
                                 timeout=240, COMMLIB_TIMEOUT="60")
    assert code == 0, out
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", out).group(1))
    assert accuracy > 0.7, out
    with open(trace + ".json") as f:
        events = json.load(f)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    # one bucket exchange per bucket per step on each rank, and SyncBatchNorm's allreduces
    # (2 layers, forward and backward) on the main thread of each rank
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        steps = {e["args"]["step"] for e in mine if e["name"] == "bucket_exchange"}
        buckets = {e["args"]["bucket"] for e in mine if e["name"] == "bucket_exchange"}
        assert len([e for e in mine if e["name"] == "bucket_exchange"]) == \
            len(steps) * len(buckets) > 0
        bn = [e for e in mine if e["name"] == "allreduce" and e["args"]["group"] == "world"
              and e["args"]["bytes"] in (8 * (2 * 32 + 1), 16 * 32, 8 * (2 * 64 + 1), 16 * 64)]
        assert len(bn) == 4 * len(steps)


def test_train_large_fits_only_when_sharded():
    """The larger-model example: under the same per-rank budget FULL_SHARD trains (the
    measured state stays within it) and replication is stopped at the first step."""
    code, _, out = run_mpi(2, ["-m", "commlib.examples.train_large", "--steps", "4"],
                           timeout=240, COMMLIB_TIMEOUT="60")
    assert code == 0 and "within budget for 4 steps" in out, out
    total = float(re.search(r"\| ([0-9.]+) MiB \|\n", out).group(1))
    assert total <= 40.0, out
    code, _, out = run_mpi(2, ["-m", "commlib.examples.train_large", "--steps", "4",
                               "--sharding", "NO_SHARD"], timeout=240, COMMLIB_TIMEOUT="60")
    assert code == 3 and "exceeds the budget" in out, out
