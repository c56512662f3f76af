"""Horovod's delta optimizer for ``DistributedOptimizer(op=hvd.Adasum)`` on several ranks.

When a parameter's gradient is ready, the wrapped optimizer steps that parameter alone
from a zero start, so the parameter holds the update ``delta = -lr * f(g)``; the deltas
are combined across ranks with Adasum (a named, negotiated allreduce,
:mod:`commlib.horovod.adasum`, any world size), and ``step()`` adds the combined delta to
the parameter's value from before the local step.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .controller import synchronize
from .execute import Adasum
from .names import named_parameters as _named
from .ops import allreduce_async_


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    def __init__(self, params: Any, named_parameters: Any, compression: Any,
                 backward_passes_per_step: int = 1) -> None:
        super(self.__class__, self).__init__(params)
        self._compression = compression
        named = _named(self.param_groups, named_parameters)
        self._parameter_names = {v: k for k, v in sorted(named, key=lambda kv: kv[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: backward_passes_per_step for _, v in named}
        self._handles: dict = {}
        self._requires_update: set = set()
        self._synchronized = False
        self._should_synchronize = True
        self._starting_models = {p: torch.zeros_like(p, requires_grad=False) for _, p in named}
        self._hooks = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = p.data.new(p.size()).zero_()
                    self._requires_update.add(p)
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _allreduce_grad_async(self, p: torch.Tensor) -> tuple:
        start = self._starting_models[p]
        stashed = []
        for group in self.param_groups:
            stashed.append(group["params"])
            group["params"] = [p] if any(p is v for v in group["params"]) else []
        try:
            start.data.copy_(p)
            super(self.__class__, self).step()
            p.data.sub_(start)   # p now holds this rank's delta
        finally:
            for saved, group in zip(stashed, self.param_groups):
                group["params"] = saved
        compressed, ctx = self._compression.compress(p.data)
        handle = allreduce_async_(compressed, name=self._parameter_names.get(p), op=Adasum)
        return handle, ctx, compressed

    def _make_hook(self, p: torch.Tensor) -> Any:
        def hook(param: torch.Tensor) -> None:
            if p in self._handles and self._handles[p][0] is not None:
                if self._allreduce_delay[p] <= 0:
                    raise AssertionError(
                        "Gradients were computed more than backward_passes_per_step times "
                        "before call to step(). Increase backward_passes_per_step to "
                        "accumulate gradients locally.")
            self._allreduce_delay[p] -= 1
            entry = (None, None, None)
            if self._allreduce_delay[p] == 0:
                entry = self._allreduce_grad_async(p)
            self._handles[p] = entry
        return hook

    def synchronize(self) -> None:
        pass

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError("Skipping synchronization is not supported when using Adasum "
                             "optimizer.")
        yield  # pragma: no cover

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for p in self._requires_update - set(self._handles):
            self._handles[p] = self._allreduce_grad_async(p)
        # The same order on every rank is not needed: the allreduces are matched by name.
        for p, (handle, ctx, compressed) in list(self._handles.items()):
            if handle is None:
                handle, ctx, compressed = self._allreduce_grad_async(p)
            delta = self._compression.decompress(synchronize(handle), ctx)
            start = self._starting_models[p]
            start.data.add_(delta.data)
            p.data.copy_(start)
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        return loss

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(*args, **kwargs)
