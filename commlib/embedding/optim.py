"""Row-wise sparse optimizers applied by the owner of the rows to its shard.

Each update goes through the same torch sparse operations as ``torch.optim.SGD`` and
``torch.optim.Adagrad`` on a ``sparse=True`` embedding gradient, so one rank reproduces
them bit for bit. Optimizer state lives with the shard (1/n of the table per rank).
"""
from __future__ import annotations

import torch


class RowOptimizer:
    """Base: ``apply(weight, rows, grad)`` updates ``weight[rows]`` in place.

    ``weight``: (local_rows, dim) shard; ``rows``: 1-D int64 sorted unique local rows;
    ``grad``: (len(rows), dim), the gradient of each row (already averaged over the group).
    """

    name = "base"

    def __init__(self, lr: float) -> None:
        if not lr >= 0.0:
            raise ValueError(f"argument 'lr' must be a non-negative float, got {lr!r}")
        self.lr = float(lr)

    def init_state(self, weight: torch.Tensor) -> None:
        pass

    def apply(self, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}


def _sparse(rows: torch.Tensor, values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, like.shape,
                                   check_invariants=False).coalesce()


class RowSGD(RowOptimizer):
    """``w[r] -= lr * g[r]`` (``torch.optim.SGD`` without momentum on a sparse gradient)."""

    name = "sgd"

    def apply(self, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
        if rows.numel():
            weight.add_(_sparse(rows, grad, weight), alpha=-self.lr)


class RowAdagrad(RowOptimizer):
    """``torch.optim.Adagrad`` (no lr decay, no weight decay) restricted to the rows of a
    sparse gradient: ``s[r] += g^2; w[r] -= lr * g / (sqrt(s[r]) + eps)``."""

    name = "adagrad"

    def __init__(self, lr: float, eps: float = 1e-10,
                 initial_accumulator_value: float = 0.0) -> None:
        super().__init__(lr)
        self.eps = float(eps)
        self.initial = float(initial_accumulator_value)
        self.state_sum: torch.Tensor | None = None

    def init_state(self, weight: torch.Tensor) -> None:
        self.state_sum = torch.full_like(weight, self.initial)

    def apply(self, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
        if not rows.numel():
            return
        g = _sparse(rows, grad, weight)
        idx, vals = g._indices(), g._values()
        self.state_sum.add_(torch.sparse_coo_tensor(idx, vals.pow(2), weight.shape,
                                                     check_invariants=False))
        std = self.state_sum.sparse_mask(g)
        std_values = std._values().sqrt_().add_(self.eps)
        weight.add_(torch.sparse_coo_tensor(idx, vals / std_values, weight.shape,
                                            check_invariants=False),
                    alpha=-self.lr)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"sum": self.state_sum}


OPTIMIZERS = {"sgd": RowSGD, "adagrad": RowAdagrad}


def make_optimizer(name: str, lr: float, rank: int) -> RowOptimizer:
    if isinstance(name, RowOptimizer):
        return name
    if name not in OPTIMIZERS:
        raise ValueError(f"ShardedEmbeddingBag on rank {rank}: argument 'optimizer' must be "
                         f"one of {sorted(OPTIMIZERS)}, got {name!r}")
    return OPTIMIZERS[name](lr)
