"""Fault tolerance in the store-backed world (``commlib.mpi.launch``: ranks started without
``mpiexec``, as a Kubernetes job or ``srun`` starts them; rank 0 hosts the store): a rank
dies alone and the others go on (issue 21 section 3). Failure detection there is
:class:`commlib.fault.fault_tolerance.StoreDetector` (process ids on one host, heartbeats in the
store across hosts). Each job under an outer timeout.

* SIGKILL of rank 3 mid-training in ``elastic_train_program.py``: the survivors' final
  parameters equal exactly those of the reference (the per-rank mpiexec run);
* not survived (the store lives in rank 0): SIGKILL of rank 0 ends every rank, none hangs.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from elastic_common import (
    HERE,
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
FT_PROGRAM = os.path.join(HERE, "elastic_ft_program.py")


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


@requires_store_world
def test_the_store_host_dying_ends_every_rank(tmp_path):
    """Not survived: rank 0 hosts the store; its death ends the others (status 1). The
    survivors shrink and go on iterating (without end: the launch monitor notices the lost
    store after two polls, about 1 s, and a run of a fixed length could finish first and
    exit 0: seen under load) until the monitor ends them."""
    codes, _, out, left = run_store_job(N, [FT_PROGRAM, str(tmp_path), "kill", "--victim-rank",
                                            "0", "--iters", "100000000"], OUTER_S,
                                        COMMLIB_TIMEOUT="60", COMMLIB_FAULT_TOLERANT="1")
    assert -9 not in codes[1:] and not left, (codes, out[-3000:])
    assert codes[0] == -9 and all(c == 1 for c in codes[1:]), (codes, out[-3000:])
    assert "lost" in out and not results(str(tmp_path))
