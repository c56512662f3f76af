"""Fault tolerance in the store-backed world (``commlib.launch``: ranks started without
``mpiexec``, as a Kubernetes job or ``srun`` starts them; rank 0 hosts the store): a rank
dies alone and the others go on (issue 21 section 3). Failure detection there is
:class:`commlib.fault_tolerance.StoreDetector` (process ids on one host, heartbeats in the
store across hosts). Each job under an outer timeout.

* SIGKILL of rank 3 of 4 in ``elastic_ft_program.py``: the survivors shrink, agree and
  finish every collective exactly, exiting 0;
* SIGKILL of rank 3 mid-training in ``elastic_train_program.py``: the survivors' final
  parameters equal exactly those of the reference run in the same world;
* not survived (the store lives in rank 0): SIGKILL of rank 0 ends every rank, none hangs.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from elastic_common import HERE, leftover_shm, reference_args, results, run_store_job
from helpers import serial_only

pytestmark = [serial_only, pytest.mark.timeout(600)]
N = 4
OUTER_S = 150
FT_PROGRAM = os.path.join(HERE, "elastic_ft_program.py")
TRAIN_PROGRAM = os.path.join(HERE, "elastic_train_program.py")


def test_a_rank_dies_alone(tmp_path):
    codes, _, out, left = run_store_job(N, [FT_PROGRAM, str(tmp_path), "kill"], OUTER_S,
                                        COMMLIB_TIMEOUT="60", COMMLIB_FAULT_TOLERANT="1")
    assert codes == [0, 0, 0, -9] and not left, (codes, out[-3000:])
    found = results(str(tmp_path))
    assert sorted(found) == [0, 1, 2]
    for r in found.values():
        assert r["iters"] == 60 and [g["size"] for g in r["groups"]] == [4, 3], r
    assert not leftover_shm(str(tmp_path))


def test_training_goes_on_exactly(tmp_path, tmp_path_factory):
    codes, _, out, left = run_store_job(N, [TRAIN_PROGRAM, str(tmp_path), "--fault", "kill"],
                                        OUTER_S, COMMLIB_TIMEOUT="60")
    assert codes == [0, 0, 0, -9] and not left, (codes, out[-3000:])
    found = results(str(tmp_path))
    assert sorted(found) == [0, 1, 2], out[-3000:]
    victims, steps = reference_args(found)
    ref_dir = tmp_path_factory.mktemp("store-reference")
    codes, _, out, left = run_store_job(N, [TRAIN_PROGRAM, str(ref_dir), "--victims", victims,
                                            "--reference", steps], OUTER_S,
                                        COMMLIB_TIMEOUT="60")
    assert codes == [0] * N and not left, (codes, out[-3000:])
    ref = results(str(ref_dir))
    for rank in (0, 1, 2):
        a = np.frombuffer(bytes.fromhex(found[rank]["params"]))
        b = np.frombuffer(bytes.fromhex(ref[rank]["params"]))
        assert np.array_equal(a, b), f"rank {rank}: differs from the reference"
        assert found[rank]["ledger"] == ref[rank]["ledger"]
    assert not leftover_shm(str(tmp_path))


def test_the_store_host_dying_ends_every_rank(tmp_path):
    """Not survived: rank 0 hosts the store; its death ends the others (status 1)."""
    codes, _, out, left = run_store_job(N, [FT_PROGRAM, str(tmp_path), "kill", "--victim-rank",
                                            "0"], OUTER_S, COMMLIB_TIMEOUT="60",
                                        COMMLIB_FAULT_TOLERANT="1")
    assert -9 not in codes[1:] and not left, (codes, out[-3000:])
    assert codes[0] == -9 and all(c == 1 for c in codes[1:]), (codes, out[-3000:])
    assert "lost" in out
