"""Train a fixed problem with a given algorithm on every rank's shard; shared by the
algorithm tests. The problem: multinomial logistic regression on scikit-learn's digits,
deterministic data, the same initial weights everywhere."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import commlib
from commlib import accounting

_DATA = None


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    global _DATA
    if _DATA is None:
        from sklearn.datasets import load_digits
        d = load_digits()
        _DATA = (torch.tensor(d.data / 16.0, dtype=torch.float32),
                 torch.tensor(d.target, dtype=torch.long))
    return _DATA


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))


def full_loss(module: torch.nn.Module) -> float:
    x, y = digits()
    with torch.no_grad():
        return float(F.cross_entropy(module(x), y))


def train(algorithm: str, steps: int = 60, batch: int = 16, lr: float = 0.1,
          optimizer: str = "sgd", finish=None, count_from: int = 0, **kwargs) -> dict:
    """Train ``steps`` steps; return the loss of the averaged model on the whole set, this
    rank's byte counters over steps ``count_from..steps-1``, and the DDP wrapper (closed).
    ``optimizer``: "sgd" or a callable ``ddp -> optimizer``."""
    rank, n = commlib.get_rank(), commlib.get_world_size()
    x, y = digits()
    ddp = commlib.DistributedDataParallel(model(), algorithm=algorithm, **kwargs)
    opt = (torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9) if optimizer == "sgd"
           else optimizer(ddp))
    g = torch.Generator().manual_seed(1234 + rank)
    mine = torch.arange(rank, len(y), n)
    losses = []
    commlib.stats(reset=True)
    try:
        for step in range(steps):
            if step == count_from:
                commlib.stats(reset=True)
            idx = mine[torch.randint(0, len(mine), (batch,), generator=g)]
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x[idx]), y[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        counters = commlib.stats(reset=True)
        if finish is not None:
            finish(ddp)
        before_average = [p.detach().clone() for p in ddp.module.parameters()]
        ddp.average_parameters()
        return {"loss": full_loss(ddp.module), "stats": counters, "ddp": ddp,
                "before_average": before_average, "losses": losses}
    finally:
        ddp.close()


def bus_bytes(counters: dict) -> int:
    return accounting.total(counters, "bus_bytes")


def same_everywhere(tensors) -> bool:
    mine = torch.cat([t.detach().reshape(-1) for t in tensors]).double().numpy()
    everyone = commlib.allgather(mine)
    return bool(all(np.array_equal(e, mine) for e in everyone))
