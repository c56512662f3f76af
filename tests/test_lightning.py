"""PyTorch Lightning on commlib, under ``mpiexec -n 2`` and ``-n 3`` (one job each, every
run from the same seed in float64, see ``lightning_program.py``):

* ``CommlibStrategy`` (commlib's DDP, gradient_allreduce; also by its registered name
  ``strategy="commlib"``) and ``DDPStrategy(process_group_backend="commlib")`` (torch's DDP
  over commlib's backend) end with the parameters of ``DDPStrategy`` over gloo, with
  ``self.log(..., sync_dist=True)`` in training and validation;
* every algorithm (bytegrad, local_sgd, decentralized) trains (near the reference: its
  parameters within 0.05) and leaves every replica identical in every checkpoint and at the
  end of ``fit`` (each rank's checksum compared).

No state dict Lightning takes holds replicas that differ: no ``RelaxedReplicaWarning``
(commlib's warning for a state dict of replicas apart, issue 30) in any run.

Negative controls: gradients summed instead of averaged must not match the reference, and
``local_sgd`` without the strategy's averaging must leave replicas that differ, its first
checkpoint warning once per rank.
"""
import json
import os
import re

import pytest

from helpers import require, run_mpi, serial_only

pytest.importorskip("torch")
require("lightning")
PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_program.py")
pytestmark = serial_only

EQUAL = ["commlib", "torch_commlib"]
ALGORITHMS = ["commlib:bytegrad", "commlib:local_sgd", "commlib:decentralized"]
CONTROLS = ["sum", "noavg:local_sgd"]


def identical(reports, run, n):
    """{epoch or 'end': the ranks' checksums} for ``run``, each rank reported once."""
    found = {}
    for r in reports:
        if r["run"] == run:
            key = "end" if r["what"] == "end" else r["epoch"]
            found.setdefault(key, {})[r["rank"]] = r["sha"]
    assert set(found) == {0, 1, "end"}, (run, found)
    for key, shas in found.items():
        assert sorted(shas) == list(range(n)), (run, key, shas)
    return {key: len(set(shas.values())) == 1 for key, shas in found.items()}


@pytest.mark.parametrize("n", [2, 3])
def test_lightning_strategies_match_gloo_and_keep_replicas_identical(tmp_path, n):
    runs = ["ref"] + EQUAL + ALGORITHMS + CONTROLS
    code, _, out = run_mpi(n, [PROGRAM, *runs], timeout=600, OMP_NUM_THREADS="1",
                           LIGHTNING_PROGRAM_ROOT=str(tmp_path))
    assert code == 0, f"exit status {code}; output ends with:\n{out[-4000:]}"
    reports = [json.loads(m) for m in re.findall(r"LIGHTNING (\{.*\})", out)]
    ends = {(r["run"], r["rank"]): r for r in reports if r["what"] == "end"}
    for run in runs:
        for rank in range(n):
            end = ends[(run, rank)]
            assert {"train_loss_epoch", "val_loss"} <= set(end["logged"]), end
            assert end["sha"] != end["initial"], ("did not train", end)
            if run in ALGORITHMS:  # they train about as the reference does
                assert end["ref_diff"] < 0.05, end
            assert end["relaxed_warnings"] == (1 if run == "noavg:local_sgd" else 0), end
            if run in EQUAL:
                # float64; 3 ranks sum in another order than gloo
                assert end["ref_diff"] <= (0 if n == 2 else 1e-12), end
    assert ends[("commlib", 0)]["strategy"] == "CommlibStrategy"
    assert ends[("commlib", 0)]["wrapper"] == "commlib.ddp.wrapper.DistributedDataParallel"
    assert ends[("torch_commlib", 0)]["wrapper"] == \
        "torch.nn.parallel.distributed.DistributedDataParallel"
    for run in ["ref"] + EQUAL + ALGORITHMS + ["sum"]:
        assert all(identical(reports, run, n).values()), (run, identical(reports, run, n))
    for run in runs:
        print(f"CHECKSUMS Lightning {run} at {n} ranks: "
              f"{sorted({ends[(run, r)]['sha'] for r in range(n)})}")
    # Negative controls.
    for rank in range(n):
        assert ends[("sum", rank)]["ref_diff"] > 1e-3, ends[("sum", rank)]
    apart = identical(reports, "noavg:local_sgd", n)
    assert not apart["end"] and not apart[1], apart
