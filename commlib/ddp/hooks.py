"""Gradient readiness during backward: per-parameter hooks, in-order bucket launches and
the end-of-backward barrier."""
from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch

from ..algorithms.base import Algorithm, Context
from ..algorithms.buckets import Bucket
from ..primitives import allreduce
from ..reduce_ops import ReduceOp
from .engine import Engine


class GradientHooks:
    """Marks gradients ready as autograd accumulates them, launches each bucket's exchange
    once all its gradients are in (buckets strictly in index order, so every rank issues
    the same collectives in the same order), and, at the end of backward, waits for every
    exchange before ``backward()`` returns."""

    def __init__(self, ctx: Context, algorithm: Algorithm, engine: Engine,
                 find_unused: bool) -> None:
        self.ctx, self.algorithm, self.engine = ctx, algorithm, engine
        self.find_unused = find_unused
        self.active = False
        self._slots: dict[int, tuple[Bucket, int]] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                         for _, p in ctx.named_parameters if p.requires_grad]
        self._reset_step()

    def attach(self, buckets: list[Bucket], exchange_gradients: bool) -> None:
        """(Re)bind gradients to bucket views; called whenever buckets are rebuilt."""
        self.active = exchange_gradients
        self._slots = {}
        if not exchange_gradients:
            return
        for bucket in buckets:
            for i, p in enumerate(bucket.tensors):
                self._slots[id(p)] = (bucket, i)
                if p.grad is not None:
                    bucket.views[i].copy_(p.grad)
                    p.grad = bucket.views[i]
        self._reset_step()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def expect_backward(self, reached: set[int] | None, exchange: bool) -> None:
        """Called after each forward with grad enabled: the next backward exchanges iff
        ``exchange``; ``reached`` are the parameters the forward reached (unused detection)."""
        self._exchange = exchange and self.active
        self._reached = reached

    # -- during backward ------------------------------------------------------------------
    def _reset_step(self) -> None:
        self._started = False
        self._exchange = self.active
        self._reached: set[int] | None = None
        self._next = 0
        self._futures: list[Future] = []
        self._touched: set[int] = getattr(self, "_touched", set())
        self._had_grad: dict[int, bool] = {}
        for bucket in self.ctx.buckets if self.active else []:
            bucket.pending = len(bucket)

    def _on_grad(self, p: torch.Tensor) -> None:
        slot = self._slots.get(id(p))
        if slot is None:
            return
        bucket, i = slot
        view = bucket.views[i]
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view
        self._touched.add(id(p))
        if not self._exchange:
            return
        if not self._started:
            self._start_backward()
        self._mark_ready(bucket)

    def _start_backward(self) -> None:
        self._started = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if self.find_unused and self._reached is not None:
            for bucket in self.ctx.buckets:
                for i, p in enumerate(bucket.tensors):
                    if id(p) not in self._reached and id(p) not in self._touched:
                        self._mark_unused(bucket, i, p)

    def _mark_unused(self, bucket: Bucket, i: int, p: torch.Tensor) -> None:
        self._had_grad[id(p)] = p.grad is not None
        if p.grad is None:
            bucket.views[i].zero_()
        self._mark_ready(bucket)

    def _mark_ready(self, bucket: Bucket) -> None:
        bucket.pending -= 1
        buckets = self.ctx.buckets
        while self._next < len(buckets) and buckets[self._next].pending == 0:
            b = buckets[self._next]
            self._futures.append(self.engine.submit(self.algorithm.on_bucket_ready, self.ctx, b))
            self._next += 1

    def _finish_backward(self) -> None:
        try:
            missing = [n for b in self.ctx.buckets[self._next:]
                       for n, p in zip(b.names, b.tensors)
                       if id(p) not in self._touched and id(p) not in self._had_grad]
            for f in self._futures:
                f.result()
            if missing:
                raise RuntimeError(
                    f"commlib.DistributedDataParallel (rank {self.ctx.rank}): parameters "
                    f"received no gradient in this backward pass: {missing[:8]}"
                    f"{' ...' if len(missing) > 8 else ''}. Pass find_unused_parameters=True "
                    f"if parts of the model are unused in some steps (the forward output must "
                    f"depend on every other parameter).")
            if self.find_unused:
                self._restore_globally_unused()
            self.ctx.backward_passes += 1
            self.algorithm.after_backward(self.ctx)
        finally:
            self._touched = set()
            self._reset_step()

    def _restore_globally_unused(self) -> None:
        """Parameters no rank used keep the gradient they had (``None`` stays ``None``)."""
        params = [p for b in self.ctx.buckets for p in b.tensors]
        used = np.array([id(p) not in self._had_grad for p in params], dtype=np.uint8)
        self.ctx.run(allreduce, used, ReduceOp.MAX, self.ctx.group)
        for p, u in zip(params, used):
            if not u and not self._had_grad.get(id(p), True):
                p.grad = None
            elif p.grad is None:
                bucket, i = self._slots[id(p)]
                p.grad = bucket.views[i]
