"""The main job runs end to end under mpiexec and learns."""
import re

import pytest

from helpers import run_mpi, serial_only

pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytestmark = serial_only


def test_train_digits_on_two_ranks():
    code, seconds, out = run_mpi(2, ["-m", "commlib.examples.train_digits", "--epochs", "3",
                                     "--no-progress"], timeout=240, COMMLIB_TIMEOUT="60")
    assert code == 0, out
    assert out.count("epoch ") == 3 and "samples/s" in out
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", out).group(1))
    assert accuracy > 0.85, out


def test_selftest_passes_on_three_ranks():
    code, seconds, out = run_mpi(3, ["-m", "commlib.selftest", "--size-mb", "0.25",
                                     "--reps", "2"], timeout=120, COMMLIB_TIMEOUT="60")
    assert code == 0 and "self-test PASSED" in out, out
