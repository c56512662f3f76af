"""The optimizer half of ``qadam`` (:mod:`commlib.algorithms.qadam`): Adam whose variance
is frozen when the algorithm's warm-up ends, after which the momentum lives in the
algorithm's bucket buffers."""
from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch


class QAdamOptimizer(torch.optim.Optimizer):
    """Adam that freezes its variance when ``qadam`` ends the warm-up; afterwards the
    momentum is maintained (and averaged) by the algorithm, not by the optimizer.

    ``variance_floor``: when the variance is frozen, each element's bias-corrected variance
    is raised to at least ``variance_floor`` times the mean of its tensor. An element that
    saw no gradient during the warm-up (a pixel that is always zero in those batches) would
    otherwise be divided by ``eps`` alone the first time it gets one. A parameter that took
    no warm-up step at all (``warmup_steps=0``) has no variance to freeze: its denominator
    is ``1 + eps``, and its step is ``lr`` times the bias-corrected averaged momentum.

    Once frozen, ``state[p]["exp_avg"]`` and ``state[p]["denom"]`` are views into the
    algorithm's bucket buffers. :meth:`state_dict` saves them with the phase;
    :meth:`load_state_dict` restores them into those buffers (the views stay bound), so
    ``opt.load_state_dict(...)`` and ``ddp.algorithm.load_state_dict(...)`` may come in
    either order.
    """

    # Live instances, oldest first: qadam finds the optimizer of its parameters here when
    # compression starts before the optimizer ever stepped (warmup_steps=0, a resumed run).
    _instances: ClassVar[list[weakref.ref]] = []

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, variance_floor: float = 1e-4) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      variance_floor=variance_floor))
        self.compressing = False
        self._binder: weakref.ref | None = None  # the qadam algorithm holding our state
        QAdamOptimizer._instances = [r for r in QAdamOptimizer._instances if r() is not None]
        QAdamOptimizer._instances.append(weakref.ref(self))

    @classmethod
    def holding(cls, params: Iterable[torch.Tensor]) -> QAdamOptimizer | None:
        """The newest live QAdamOptimizer that holds any of ``params``, or ``None``."""
        wanted = {id(p) for p in params}
        for ref in reversed(cls._instances):
            opt = ref()
            if opt is not None and any(id(p) in wanted for g in opt.param_groups
                                       for p in g["params"]):
                return opt
        return None

    @torch.no_grad()
    def freeze(self) -> None:
        """End of warm-up: fix ``state["denom"] = sqrt(max(v_hat, floor)) + eps`` per
        parameter (``1 + eps`` for a parameter without warm-up step); steps from now on
        use the momentum the algorithm maintains."""
        self.compressing = True
        for group in self.param_groups:
            beta2 = group["betas"][1]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(step=0, frozen_step=0, exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p))
                if state["frozen_step"] == 0:
                    state["denom"] = torch.ones_like(p).add_(group["eps"])
                    continue
                v_hat = state["exp_avg_sq"] / (1 - beta2 ** state["frozen_step"])
                floor = group["variance_floor"] * v_hat.mean()
                state["denom"] = v_hat.clamp_(min=float(floor)).sqrt_().add_(group["eps"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():  # as torch's optimizers call it (step() is no_grad)
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    state["frozen_step"] = 0
                state["step"] += 1
                if not self.compressing:
                    g = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] \
                        else p.grad
                    state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
                    state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    state["frozen_step"] = state["step"]
                m_hat = 1 - beta1 ** state["step"]
                if self.compressing:
                    denom = state["denom"]
                else:
                    v_hat = 1 - beta2 ** state["frozen_step"]
                    denom = (state["exp_avg_sq"] / v_hat).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / m_hat)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state (per parameter ``step``, ``frozen_step``, ``exp_avg``,
        ``exp_avg_sq`` and, once frozen, ``denom``) plus ``"compressing"``, the phase."""
        out = super().state_dict()
        out["compressing"] = self.compressing
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """torch's load, then the phase; if a ``qadam`` algorithm holds this optimizer's
        momentum and denominators in its buffers, the loaded values are written there and
        the state views them again."""
        state_dict = dict(state_dict)
        compressing = bool(state_dict.pop("compressing", False))
        super().load_state_dict(state_dict)
        self.compressing = compressing
        binder = self._binder() if self._binder is not None else None
        if binder is not None:
            binder.optimizer_loaded(self)
