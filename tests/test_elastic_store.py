"""Fault tolerance in the store-backed world (``commlib.mpi.launch``: ranks started without
``mpiexec``, as a Kubernetes job or ``srun`` starts them; rank 0 hosts the store): a rank
dies alone and the others go on (issue 21 section 3). Failure detection there is
:class:`commlib.fault.fault_tolerance.StoreDetector` (process ids on one host, heartbeats in the
store across hosts). Each job under an outer timeout.

* SIGKILL of rank 3 mid-training in ``elastic_train_program.py``: the survivors' final
  parameters equal exactly those of the reference (the per-rank mpiexec run);
* the store's host (rank 0) killed mid-training at 3 ranks, and rank 0 then the next host
  (rank 1) at 4 ranks: a standby store takes over each time
  (:mod:`commlib.mpi.launch.standby`), the survivors finish exactly as the reference that
  shrinks at the agreed steps, their next step less than a second after the kill;
* negative control, the standby off (``COMMLIB_STORE_STANDBY=0``): the same kill of rank 0
  ends every other rank with status 1, none hangs.
"""
from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest

from elastic_common import (
    TRAIN_PROGRAM,
    fault_tolerant_launch,  # noqa: F401 - skips where refused
    leftover_shm,
    params,
    reference,
    reference_args,
    results,
    run_store_job,
)
from helpers import requires_store_world, serial_only

pytestmark = [serial_only, pytest.mark.timeout(600),
              pytest.mark.usefixtures("fault_tolerant_launch")]
N = 4
OUTER_S = 150


@requires_store_world
def test_training_goes_on_exactly(tmp_path, tmp_path_factory):
    """SIGKILL of rank 3 mid-training: the survivors go on; their parameters equal bit for
    bit the reference that shrinks at the agreed step. The reference is the per-rank
    ``mpiexec`` one of test_elastic (measured bitwise equal to the same reference in the
    store-backed world: MPICH's 4-rank allreduce adds the same pairs on one host with
    shared memory), so no reference job runs here when test_elastic ran before."""
    codes, _, out, left = run_store_job(N, [TRAIN_PROGRAM, str(tmp_path), "--fault", "kill"],
                                        OUTER_S, COMMLIB_TIMEOUT="60")
    assert codes == [0, 0, 0, -9] and not left, (codes, out[-3000:])
    found = results(str(tmp_path))
    assert sorted(found) == [0, 1, 2], out[-3000:]
    for r in found.values():
        assert [s for s, _ in r["ledger"]] == list(range(1, 31)), r["ledger"]
    victims, steps = reference_args(found)
    ref = reference(tmp_path_factory, "gradient_allreduce", victims, steps)
    for rank in (0, 1, 2):
        assert np.array_equal(params(found[rank]), params(ref[rank])), \
            f"rank {rank}: differs from the reference"
        assert found[rank]["ledger"] == ref[rank]["ledger"]
    assert not leftover_shm(str(tmp_path))


def kill_to_next_step(found: dict, outdir: str) -> list[float]:
    """Seconds from each victim's SIGKILL (its ``fault{r}.json``) to the survivors' first
    step committed after it (the latest survivor's)."""
    gaps = []
    for path in sorted(glob.glob(os.path.join(outdir, "fault*.json"))):
        with open(path) as f:
            killed = json.load(f)["time"]
        gaps.append(max(min(t for _, t in r["times"] if t > killed)
                        for r in found.values()) - killed)
    return gaps


def survived(tmp_path, tmp_path_factory, n: int, victims: str, at: str,
             *extra: str) -> list[float]:
    """Kill ``victims`` at steps ``at`` in an ``n``-rank store-backed job; check the
    survivors against the reference; return the kill-to-next-step seconds."""
    codes, _, out, left = run_store_job(
        n, [TRAIN_PROGRAM, str(tmp_path), "--fault", "kill", "--victims", victims,
            "--at", at, *extra], OUTER_S, COMMLIB_TIMEOUT="60")
    dead = [int(v) for v in victims.split(",")]
    assert codes == [-9 if r in dead else 0 for r in range(n)] and not left, \
        (codes, out[-3000:])
    assert out.count("standby store is the store now") == \
        sum(n - 1 - i for i in range(len(dead))), out[-3000:]
    found = results(str(tmp_path))
    assert sorted(found) == [r for r in range(n) if r not in dead], out[-3000:]
    for r in found.values():
        assert [s for s, _ in r["ledger"]] == list(range(1, 31)), r["ledger"]
    ref_victims, steps = reference_args(found)
    assert ref_victims == victims, (ref_victims, victims)
    ref = reference(tmp_path_factory, "gradient_allreduce", ref_victims, steps, n=n)
    for rank in found:
        assert np.array_equal(params(found[rank]), params(ref[rank])), \
            f"rank {rank}: differs from the reference"
        assert found[rank]["ledger"] == ref[rank]["ledger"]
    assert not leftover_shm(str(tmp_path))
    gaps = kill_to_next_step(found, str(tmp_path))
    assert len(gaps) == len(dead) and all(0 < g < 1.0 for g in gaps), gaps
    return gaps


@requires_store_world
def test_the_store_host_dying_is_survived(tmp_path, tmp_path_factory):
    """SIGKILL of rank 0, the store's host, mid-training at 3 ranks: rank 1's standby store
    takes over; ranks 1 and 2 finish, exactly as the reference in which rank 0 leaves at
    the agreed step, their next step within a second of the kill."""
    survived(tmp_path, tmp_path_factory, 3, "0", "12")


@requires_store_world
def test_successive_store_hosts_dying_are_survived(tmp_path, tmp_path_factory):
    """4 ranks: rank 0 (the store's host) killed at step 8, then rank 1, whose standby had
    become the store, at step 20 (the steps 50 ms apart: the next standby, rank 2's, is in
    place within about 0.15 s of a failover); ranks 2 and 3 finish exactly."""
    survived(tmp_path, tmp_path_factory, 4, "0,1", "8,20", "--pause", "0.05")


@requires_store_world
def test_without_the_standby_the_store_host_dying_ends_every_rank(tmp_path):
    """Negative control: the same kill of rank 0 with ``COMMLIB_STORE_STANDBY=0`` (rank 0's
    store the single point of failure, as before): every other rank ends with status 1
    (the launch monitor notices the lost store after two polls, about 1 s; the steps are
    0.1 s apart, so the survivors cannot finish first), nothing written, nothing hangs."""
    codes, _, out, left = run_store_job(3, [TRAIN_PROGRAM, str(tmp_path), "--fault", "kill",
                                            "--victims", "0", "--at", "12", "--steps", "60",
                                            "--pause", "0.1"], OUTER_S,
                                        COMMLIB_TIMEOUT="60", COMMLIB_STORE_STANDBY="0")
    assert codes == [-9, 1, 1] and not left, (codes, out[-3000:])
    assert "lost rank 0" in out and "standby" not in out and not results(str(tmp_path))
