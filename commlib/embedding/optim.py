"""Row-wise sparse optimizers applied by the owner of the rows to its shard.

Each update goes through the same torch sparse operations as ``torch.optim.SGD``,
``torch.optim.Adagrad`` and ``torch.optim.SparseAdam`` on a ``sparse=True`` embedding
gradient, so one rank reproduces them bit for bit. Optimizer state lives with the shard
(1/n of the table per rank).
"""
from __future__ import annotations

import math

import torch


class RowOptimizer:
    """Base: ``apply(weight, rows, grad, step)`` updates ``weight[rows]`` in place.

    ``weight``: (local_rows, dim) shard; ``rows``: 1-D int64 sorted unique local rows;
    ``grad``: (len(rows), dim), the gradient of each row (already averaged over the group);
    ``step``: the 1-based index of the batch whose update this is (the same on every rank;
    what ``torch.optim`` counts as the optimizer's step).
    """

    name = "base"

    def __init__(self, lr: float) -> None:
        if not lr >= 0.0:
            raise ValueError(f"argument 'lr' must be a non-negative float, got {lr!r}")
        self.lr = float(lr)

    def init_state(self, weight: torch.Tensor) -> None:
        pass

    def apply(self, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor,
              step: int) -> None:
        raise NotImplementedError

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}


def _sparse(rows: torch.Tensor, values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, like.shape,
                                   check_invariants=False).coalesce()


class RowSGD(RowOptimizer):
    """``w[r] -= lr * g[r]`` (``torch.optim.SGD`` without momentum on a sparse gradient)."""

    name = "sgd"

    def apply(self, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor,
              step: int) -> None:
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

    def apply(self, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor,
              step: int) -> None:
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


class RowAdam(RowOptimizer):
    """``torch.optim.SparseAdam``: Adam's moments of the rows of a sparse gradient only,
    bias correction from the batch index ``step`` (every rank alike, whether or not its
    shard got rows in that batch)::

        # not run: a formula, not code
        m[r] += (1 - b1) (g - m[r]);  v[r] += (1 - b2) (g^2 - v[r])
        w[r] -= lr sqrt(1 - b2^t) / (1 - b1^t) * m[r] / (sqrt(v[r]) + eps)
    """

    name = "adam"

    def __init__(self, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        super().__init__(lr)
        if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"argument 'betas' must be two floats in [0, 1), got {betas!r}")
        self.beta1, self.beta2 = (float(b) for b in betas)
        self.eps = float(eps)
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None

    def init_state(self, weight: torch.Tensor) -> None:
        self.exp_avg = torch.zeros_like(weight)
        self.exp_avg_sq = torch.zeros_like(weight)

    def apply(self, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor,
              step: int) -> None:
        if not rows.numel():
            return
        # torch.optim._functional.sparse_adam's operations, in its order (bit for bit)
        g = _sparse(rows, grad, weight)
        idx, vals = g._indices(), g._values()

        def make(values: torch.Tensor) -> torch.Tensor:
            return torch.sparse_coo_tensor(idx, values, weight.shape, check_invariants=False)

        old_m = self.exp_avg.sparse_mask(g)._values()
        m_update = vals.sub(old_m).mul_(1 - self.beta1)
        self.exp_avg.add_(make(m_update))
        old_v = self.exp_avg_sq.sparse_mask(g)._values()
        v_update = vals.pow(2).sub_(old_v).mul_(1 - self.beta2)
        self.exp_avg_sq.add_(make(v_update))
        numer = m_update.add_(old_m)
        v_update.add_(old_v)
        denom = v_update.sqrt_().add_(self.eps)
        step_size = self.lr * math.sqrt(1 - self.beta2 ** step) / (1 - self.beta1 ** step)
        weight.add_(make(-step_size * numer.div_(denom)))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


OPTIMIZERS = {"sgd": RowSGD, "adagrad": RowAdagrad, "adam": RowAdam}


def make_optimizer(name: str, lr: float, rank: int) -> RowOptimizer:
    if isinstance(name, RowOptimizer):
        return name
    if name not in OPTIMIZERS:
        raise ValueError(f"ShardedEmbeddingBag on rank {rank}: argument 'optimizer' must be "
                         f"one of {sorted(OPTIMIZERS)}, got {name!r}")
    return OPTIMIZERS[name](lr)
