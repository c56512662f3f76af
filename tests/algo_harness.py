"""Train a fixed problem with a given algorithm on every rank's shard; shared by the
algorithm tests. The problem: a small tanh network on scikit-learn's digits, deterministic
data, the same initial weights everywhere.

Shards are label-skewed (rank ``r`` mostly sees the classes ``c`` with ``c % n == r``), so
a replica that learns from its own shard alone cannot classify the other classes: an
algorithm that does not communicate, or communicates the wrong thing, shows in the loss
of each replica, which is measured on every rank's own model (never on an average).
Buckets are small (:data:`BUCKET_MB`): the model spans at least three of them, and the
optimizer has two param groups (weights with weight decay, biases without).
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

import commlib
from commlib.base import accounting

BUCKET_MB = 0.005  # the model below spans 3 buckets (the first holds 3 tensors)
SKEW = 0.8   # fraction of a rank's examples drawn from its own classes
_DATA = None


def digits(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    global _DATA
    if _DATA is None:
        from sklearn.datasets import load_digits
        d = load_digits()
        _DATA = (torch.tensor(d.data / 16.0, dtype=torch.float64),
                 torch.tensor(d.target, dtype=torch.long))
    return _DATA[0].to(dtype), _DATA[1]


def model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 10)).to(dtype)


def param_groups(module: torch.nn.Module, weight_decay: float = 1e-3, **bias_group) -> list:
    """Two param groups: weights (with ``weight_decay``), biases (none; ``bias_group``
    overrides other hyperparameters, e.g. ``betas``)."""
    weights = [p for n, p in module.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in module.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "weight_decay": weight_decay},
            {"params": biases, "weight_decay": 0.0, **bias_group}]


def sgd(ddp, lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD(param_groups(ddp.module), lr=lr, momentum=0.9)


def batch_indices(rank: int, n: int, step: int, batch: int = 16,
                  skew: float = SKEW) -> torch.Tensor:
    """Rank ``rank``'s examples at ``step``: a fraction ``skew`` from its own classes, the
    rest from the whole set; a function of (rank, step) only, so resumed runs see the same
    batches."""
    _, y = digits()
    g = torch.Generator().manual_seed(1000 * step + rank)
    own = torch.nonzero(y % n == rank).squeeze(1) if n > 1 else torch.arange(len(y))
    k = int(round(batch * skew))
    mine = own[torch.randint(0, len(own), (k,), generator=g)]
    rest = torch.randint(0, len(y), (batch - k,), generator=g)
    return torch.cat([mine, rest])


def full_loss(module: torch.nn.Module) -> float:
    p = next(module.parameters())
    x, y = digits(p.dtype)
    with torch.no_grad():
        return float(F.cross_entropy(module(x), y))


def replica_losses(module: torch.nn.Module) -> list[float]:
    """The whole-set loss of every rank's own model (no averaging), in rank order."""
    return [float(v) for v in commlib.allgather(np.array([full_loss(module)]))[:, 0]]


def train(algorithm, steps: int = 60, batch: int = 16, lr: float = 0.1,
          optimizer=None, finish=None, count_from: int = 0, dtype=torch.float32,
          on_step=None, bucket_cap_mb: float = BUCKET_MB, settle_hook=None,
          **kwargs) -> dict:
    """Train ``steps`` iterations; returns ``losses`` (every replica's whole-set loss at
    the end, in rank order, measured on each rank's own model before anything averages
    it), this rank's byte counters over steps ``count_from..steps-1``, the per-step
    training losses and the DDP wrapper (closed). ``optimizer``: ``None`` (SGD with
    momentum, two param groups) or a callable ``ddp -> optimizer``. ``on_step(step, ddp)``
    runs after each ``optimizer.step()``; ``settle_hook(ddp)`` after the last one, before
    the replicas are settled and measured; ``finish(ddp)`` after they were measured."""
    rank, n = commlib.get_rank(), commlib.get_world_size()
    x, y = digits(dtype)
    ddp = commlib.DistributedDataParallel(model(dtype), algorithm=algorithm,
                                          bucket_cap_mb=bucket_cap_mb, **kwargs)
    assert len(ddp._ctx.buckets) >= 3 or bucket_cap_mb != BUCKET_MB, ddp._ctx.buckets
    opt = sgd(ddp, lr) if optimizer is None else optimizer(ddp)
    train_losses = []
    commlib.stats(reset=True)
    try:
        for step in range(steps):
            if step == count_from:
                commlib.stats(reset=True)
            idx = batch_indices(rank, n, step, batch)
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x[idx]), y[idx])
            loss.backward()
            opt.step()
            train_losses.append(loss.item())
            if on_step is not None:
                on_step(step, ddp)
        counters = commlib.stats(reset=True)
        if settle_hook is not None:
            settle_hook(ddp)
        settle(ddp, x[:1])
        losses = replica_losses(ddp.module)
        if finish is not None:
            finish(ddp)
        return {"losses": losses, "loss": max(losses), "stats": counters, "ddp": ddp,
                "train_losses": train_losses}
    finally:
        ddp.close()


def settle(ddp, x: torch.Tensor) -> None:
    """Let the last iteration's end-of-iteration work run (a local SGD average due after
    it, a gossip round, a queued background correction), as the next training forward
    would, without a backward: the replicas are then what the next iteration starts
    from. Nothing is averaged beyond what the algorithm itself does."""
    with torch.enable_grad():
        ddp(x)


def wait_for_rounds(algorithm, rounds: int, limit_s: float = 60.0) -> None:
    """Wait until a background-averaging algorithm completed ``rounds`` rounds on this
    rank (rounds are collective, so every rank gets there); fails after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while algorithm.rounds < rounds:
        assert time.monotonic() < deadline, f"only {algorithm.rounds} of {rounds} rounds"
        time.sleep(0.001)


def bus_bytes(counters: dict) -> int:
    return accounting.total(counters, "bus_bytes")


def same_everywhere(tensors) -> bool:
    mine = torch.cat([t.detach().reshape(-1) for t in tensors]).double().numpy()
    everyone = commlib.allgather(mine)
    return bool(all(np.array_equal(e, mine) for e in everyone))


def gathered(tensors) -> np.ndarray:
    """``(n, numel)`` float64: every rank's tensors, flattened and concatenated."""
    mine = torch.cat([t.detach().reshape(-1) for t in tensors]).double().numpy()
    return commlib.allgather(mine)
