"""The CTR example runs end to end under mpiexec (Bagpipe lookahead, Adagrad tables) and
learns: its test AUC clears chance by a margin."""
import re

import pytest

from helpers import require, run_mpi, serial_only

pytest.importorskip("torch")
require("sklearn")
pytestmark = serial_only


def test_train_ctr_on_two_ranks():
    code, seconds, out = run_mpi(2, ["-m", "commlib.examples.train_ctr", "--rows", "2000",
                                     "--steps", "40", "--batch", "128", "--lookahead", "2",
                                     "--test-samples", "2048"],
                                 timeout=240, COMMLIB_TIMEOUT="60")
    assert code == 0, out
    auc, teacher = map(float, re.search(r"test AUC ([0-9.]+) \(teacher ([0-9.]+)\)",
                                        out).groups())
    assert auc > 0.62 and teacher > auc, out
