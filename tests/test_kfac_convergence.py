"""d_kfac and dp_kfac train better than SGD where curvature matters, and at least as well
on the example CNN, at any world size (each rank trains on its own shard of each batch).
Every run uses SGD with momentum and the same learning rate; K-FAC's ``lr`` (for KL
clipping) is set to it."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import numpy as np  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import commlib  # noqa: E402
from commlib.algorithms.kfac import DKFAC, DPKFAC  # noqa: E402
from models import SmallCNN  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")

KFAC = ["d_kfac", "dp_kfac"]



def train(model, algorithm, lr, steps, batch_fn, eval_fn, **hp):
    """``steps`` of SGD (momentum 0.9) on this rank's shards (buckets small enough that
    the gradients span several); returns ``eval_fn(model)`` of this rank's replica, after
    checking that every rank holds bitwise the same replica (what every algorithm here
    promises; a variant that does not communicate, or communicates the wrong thing, fails
    here)."""
    rank, n = commlib.get_rank(), commlib.get_world_size()
    if algorithm != "gradient_allreduce" and not isinstance(algorithm, type):
        hp["lr"] = lr
    if isinstance(algorithm, type):
        algorithm = algorithm(lr=lr, **hp)
        hp = {}
    ddp = commlib.DistributedDataParallel(model, algorithm=algorithm, bucket_cap_mb=0.001,
                                          **hp)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    try:
        for step in range(steps):
            x, y = batch_fn(step, rank, n)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        mine = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]).numpy()
        assert all(np.array_equal(r, mine) for r in commlib.allgather(mine)), \
            f"{algorithm}: the ranks' replicas differ"
        with torch.no_grad():
            return eval_fn(ddp.module)
    finally:
        ddp.close()


class SilentDKFAC(DKFAC):
    """Negative control: K-FAC whose gradients are never averaged."""

    def on_bucket_ready(self, ctx, bucket):
        return None


class SilentDPKFAC(DPKFAC):
    def on_bucket_ready(self, ctx, bucket):
        return None


# -- badly scaled inputs: SGD cannot move the weights of the small features -------------
SCALES = torch.logspace(-2, 1, 8, dtype=torch.float64)  # input second moments 1e-4 .. 1e2
TEACHER = torch.randn(4, 8, generator=torch.Generator().manual_seed(5),
                      dtype=torch.float64) * 2 / SCALES  # every feature decides the class


def scaled_batch(seed, size):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 8, generator=g, dtype=torch.float64) * SCALES
    return x, (x @ TEACHER.T).argmax(1)


def scaled_loss(model):
    x, y = scaled_batch(10 ** 6, 2048)
    return float(F.cross_entropy(model(x), y))


def run_scaled(algorithm, **hp):
    torch.manual_seed(0)
    return train(nn.Linear(8, 4).double(), algorithm, lr=0.03, steps=60,
                 batch_fn=lambda step, rank, n: scaled_batch(step * 100 + rank, 16),
                 eval_fn=scaled_loss, **hp)


@pytest.mark.mpi
def test_kfac_beats_sgd_on_badly_scaled_inputs():
    sgd = run_scaled("gradient_allreduce")
    for algorithm in KFAC:
        loss = run_scaled(algorithm)
        assert loss < 0.6 * sgd, f"{algorithm}: loss {loss:.3f}, SGD {sgd:.3f}"
    if commlib.get_world_size() > 1:  # negative controls: rejected by the replica check
        for control in (SilentDKFAC, SilentDPKFAC):
            with pytest.raises(AssertionError, match="replicas differ"):
                run_scaled(control)


# -- the example CNN on scikit-learn's 8x8 digits ----------------------------------------
@pytest.fixture(scope="module")
def digits():
    datasets = pytest.importorskip("sklearn.datasets")
    x, y = datasets.load_digits(return_X_y=True)
    return (torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8),
            torch.tensor(y))


def run_digits(digits, algorithm, **hp):
    x, y = digits
    per_rank = 32

    def batch(step, rank, n):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, len(x), (n * per_rank,), generator=g)
        mine = idx[rank * per_rank:(rank + 1) * per_rank]
        return x[mine], y[mine]

    def evaluate(model):
        out = model(x)
        return float(F.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())

    torch.manual_seed(0)
    return train(SmallCNN(), algorithm, lr=0.05, steps=40, batch_fn=batch, eval_fn=evaluate,
                 **hp)


@pytest.mark.mpi
def test_kfac_trains_the_example_cnn_at_least_as_well_as_sgd(digits):
    sgd_loss, sgd_acc = run_digits(digits, "gradient_allreduce")
    for algorithm in KFAC:
        loss, acc = run_digits(digits, algorithm, damping=0.01)
        assert loss <= sgd_loss and acc >= sgd_acc, \
            f"{algorithm}: loss {loss:.3f} acc {acc:.3f}; SGD loss {sgd_loss:.3f} acc {sgd_acc:.3f}"
