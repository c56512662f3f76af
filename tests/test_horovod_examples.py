"""Horovod's own PyTorch examples, unchanged but for the import line, under mpiexec at 2
ranks on commlib.horovod (tests/horovod_examples/README.md: their source commit and the
torchvision stand-in they get on PYTHONPATH for these runs only)."""
import os
import re

import pytest

from helpers import require, run_mpi, serial_only

pytest.importorskip("torch")
require("sklearn")
pytestmark = serial_only
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "horovod_examples")
REPO = os.path.dirname(HERE)


def run_example(script: str, args: list, tmp_path) -> str:
    code, _, out = run_mpi(2, [os.path.join(EXAMPLES, script)] + args, timeout=240,
                           COMMLIB_TIMEOUT="60", HOME=str(tmp_path),
                           PYTHONPATH=os.pathsep.join([os.path.join(EXAMPLES, "stand_in"),
                                                       REPO]))
    assert code == 0, out
    return out


def test_the_only_change_is_the_import():
    for script in ("pytorch_mnist.py", "pytorch_synthetic_benchmark.py"):
        with open(os.path.join(EXAMPLES, script)) as f:
            text = f.read()
        assert "import commlib.horovod as hvd\n" in text and "horovod.torch" not in text


def test_pytorch_mnist_learns(tmp_path):
    out = run_example("pytorch_mnist.py", ["--epochs", "2", "--lr", "0.05", "--momentum",
                                           "0.9", "--log-interval", "5", "--data-dir",
                                           str(tmp_path / "data")], tmp_path)
    tests = [(float(a), float(b)) for a, b in
             re.findall(r"Test set: Average loss: ([0-9.]+), Accuracy: ([0-9.]+)%", out)]
    assert len(tests) == 2, out
    (loss1, _), (loss2, acc2) = tests
    # chance level is ln(10) = 2.30 and 10 %: a run that does not learn fails here
    assert loss2 < loss1 < 2.2 and acc2 > 60, out
    train = [float(x) for x in re.findall(r"Loss: ([0-9.]+)", out)]
    assert train[-1] < train[0] - 0.5, out


def test_pytorch_synthetic_benchmark_runs(tmp_path):
    out = run_example("pytorch_synthetic_benchmark.py",
                      ["--batch-size", "4", "--num-warmup-batches", "2",
                       "--num-batches-per-iter", "2", "--num-iters", "3"], tmp_path)
    assert out.count("Iter #") == 3 and "Number of CPUs: 2" in out, out
    total = float(re.search(r"Total img/sec on 2 CPU\(s\): ([0-9.]+)", out).group(1))
    assert total > 0, out
