"""Models, optimizer configurations and the replica checker shared by the sharded-training
tests (ZeroRedundancyOptimizer, FullyShardedDataParallel)."""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import commlib

TOL = 1e-10


class Tied(nn.Module):
    """An MLP with a tied (shared) weight used twice, and a frozen bias."""

    def __init__(self, d_in=10, hidden=12, d_out=4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        self.fc3.weight = self.fc2.weight
        self.head = nn.Linear(hidden, d_out)
        self.fc1.bias.requires_grad_(False)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.head(torch.relu(self.fc3(x)))


def make_model(seed=3):
    torch.manual_seed(seed)
    return Tied().double()


def data(step, n, per_rank=3):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n * per_rank, 10, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (n * per_rank,), generator=g)
    return x, y


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


# name -> (optimizer class, kwargs, split into two param groups)
OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, False),
    "adam": (torch.optim.Adam, {"lr": 0.01}, False),
    "adamw_two_groups": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}, True),
}


def two_groups(named):
    """Biases without weight decay and a larger lr, weights with the defaults."""
    biases = [p for n, p in named if n.endswith("bias")]
    weights = [p for n, p in named if not n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "weight_decay": 0.0, "lr": 0.02}]


def reference_optimizer(model, name):
    cls, kw, split = OPTIMIZERS[name]
    params = two_groups(list(model.named_parameters())) if split else model.parameters()
    return cls(params, **kw)


def replica_errors(mine: torch.Tensor, ref: torch.Tensor, group=None) -> tuple[float, bool]:
    """(max over ranks of max |mine - reference|, whether every rank holds bitwise the same
    values): the same verdict on every rank; collective over ``group`` (the world)."""
    mine = mine.detach().double().reshape(-1)
    everyone = commlib.allgather(mine.numpy(), group)
    same = all(np.array_equal(row, everyone[0]) for row in everyone)
    err = np.array([float((mine - ref.detach().double().reshape(-1)).abs().max())])
    commlib.allreduce(err, commlib.ReduceOp.MAX, group)
    return float(err[0]), same


def check_replicas(history):
    """``history``: per step (error, identical) from :func:`replica_errors`. Raises
    AssertionError naming the first step that is off."""
    for step, (err, same) in enumerate(history):
        assert same, f"step {step}: replicas differ between ranks"
        assert err <= TOL, f"step {step}: max |param - reference| = {err:.3g} > {TOL}"


def flat(params):
    return torch.cat([p.detach().reshape(-1) for p in params])
