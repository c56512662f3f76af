"""The pipeline example runs end to end under mpiexec (Chimera over 2 stages, each sharded
over 2 tensor-parallel ranks) and learns."""
import re

import pytest

from helpers import require, run_mpi, serial_only

pytest.importorskip("torch")
require("sklearn")
pytestmark = serial_only


def test_train_pipeline_chimera_tp2_on_four_ranks():
    code, seconds, out = run_mpi(4, ["-m", "commlib.examples.train_pipeline", "--schedule",
                                     "chimera", "--tp", "2", "--epochs", "3"],
                                 timeout=240, COMMLIB_TIMEOUT="60")
    assert code == 0, out
    assert "dp=1 x pp=2 x tp=2" in out and out.count("epoch ") == 3
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", out).group(1))
    assert accuracy > 0.8, out
    # each rank holds half of the (sharded) model
    counts = [int(c) for c in re.search(r"parameters per rank \[([0-9, ]+)\]", out)
              .group(1).split(",")]
    whole = int(re.search(r"whole model (\d+)", out).group(1))
    assert max(counts) < 0.6 * whole, out
