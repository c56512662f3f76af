"""Gradient readiness during backward: per-parameter hooks, in-order bucket launches and
the end-of-backward barrier.

Readiness follows torch DDP's reducer. In a backward pass outside ``no_sync`` a parameter
is ready when autograd has accumulated its gradient, or, with ``find_unused_parameters``,
when the forward output's graph does not reach it (it is marked ready at the start of
backward with whatever gradient it holds: the sum accumulated under ``no_sync``, else
zeros). A bucket is exchanged once all its parameters are ready, buckets strictly in index
order so every rank issues the same collectives. Which parameters are *used* (for keeping
globally unused gradients ``None``) counts every backward since the last exchange, as
torch's ``local_used_map`` does, so a branch used only in an accumulation micro-batch is
still averaged.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from time import perf_counter
from typing import Any

import numpy as np
import torch

from ..algorithms.base import Algorithm, Context
from ..algorithms.buckets import Bucket
from ..base import accounting
from ..base.reduce_ops import ReduceOp
from ..primitives import allgather_v, allreduce
from .engine import Engine, drive

# Readiness modes, after torch DDP's: every parameter must get a gradient ("strict"), the
# forward graph tells which will not ("find_unused"), or the first iteration tells ("static").
STRICT, FIND_UNUSED, STATIC = "strict", "find_unused", "static"


class GradientHooks:
    """Marks gradients ready as autograd accumulates them, launches each bucket's exchange
    once all its gradients are in, and, at the end of a backward pass outside ``no_sync``,
    waits for every exchange, runs ``after_backward`` and ends the iteration."""

    def __init__(self, ctx: Context, algorithm: Algorithm, engine: Engine, mode: str,
                 on_iteration_end: Callable[[], None]) -> None:
        self.ctx, self.algorithm, self.engine = ctx, algorithm, engine
        self.mode = mode
        self.on_iteration_end = on_iteration_end
        self.grad_scale = 1.0  # applied after the exchange (join with fewer ranks training)
        self.active = False
        self._names = {id(p): n for n, p in ctx.named_parameters}
        self._slots: dict[int, tuple[Bucket, int]] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                         for _, p in ctx.named_parameters if p.requires_grad]
        self._sync = True
        self._reached: set[int] | None = None
        self._used: set[int] = set()        # got a gradient since the last synced backward
        self._static_unused: set[int] | None = None
        self._used_globally: np.ndarray | None = None
        self._reset_backward()

    def attach(self, buckets: list[Bucket], exchange_gradients: bool) -> None:
        """(Re)bind gradients to bucket views; called whenever buckets are rebuilt."""
        self.active = exchange_gradients
        self._slots = {}
        if exchange_gradients:
            for bucket in buckets:
                for i, p in enumerate(bucket.tensors):
                    self._slots[id(p)] = (bucket, i)
                    if p.grad is not None:
                        _bind(p, bucket.views[i])
        self._reset_backward()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def expect_backward(self, reached: set[int] | None, sync: bool) -> None:
        """Called after each forward with grad enabled: the next backward ends an iteration
        (and exchanges) iff ``sync``; ``reached`` are the parameters the forward reached."""
        self._sync = sync
        self._reached = reached

    # -- during backward ------------------------------------------------------------------
    def _reset_backward(self) -> None:
        self._started = False
        self._ready: set[int] = set()
        self._marked_unused: set[int] = set()
        self._late: list[str] = []
        self._saved: dict[int, torch.Tensor] = {}
        self._next = 0
        self._futures: list[Future] = []
        self._events: dict[int, list[Any]] = {}
        self._deferred: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, its view)
        for bucket in self.ctx.buckets if self.active else []:
            bucket.pending = len(bucket)
            bucket.clear_sources()

    def _on_grad(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is not None and grad.layout != torch.strided:
            raise RuntimeError(
                f"commlib.DistributedDataParallel (rank {self.ctx.rank}): parameter "
                f"{self._names.get(id(p), '?')!r} received a {grad.layout} gradient; only dense "
                f"gradients are exchanged. Use dense gradients (e.g. nn.Embedding(..., "
                f"sparse=False)) or keep the parameter out of the wrapped module.")
        slot = self._slots.get(id(p))
        if slot is not None and not (self._sync and self.algorithm.fuses_bucket_copy
                                     and self._deferrable(p, slot)):
            _bind(p, slot[0].views[slot[1]])
        self._used.add(id(p))
        if not self._sync:
            return
        if not self._started:
            self._start_backward()
        if slot is None:
            return
        if id(p) in self._marked_unused:
            # torch raises here too ("marked ready twice"): the parameter was used outside
            # the forward's output graph. Reported on every rank at the end of backward.
            self._late.append(self._names.get(id(p), "?"))
            return
        self._make_ready(p, slot)

    def _deferrable(self, p: torch.Tensor, slot: tuple[Bucket, int]) -> bool:
        """Leave autograd's gradient where it is for the algorithm to gather in its
        exchange (``Algorithm.fuses_bucket_copy``): a fresh CPU gradient shaped like its
        view; ``p.grad`` becomes the view once the exchange is done."""
        bucket, i = slot
        grad, view = p.grad, bucket.views[i]
        if (grad is None or not grad.is_cpu or grad.dtype != view.dtype
                or grad.shape != view.shape or not grad.is_contiguous()
                or grad.data_ptr() == view.data_ptr() or id(p) in self._marked_unused
                or bucket.sources[i] is not None):
            return False
        bucket.sources[i] = grad
        bucket.deferred += 1
        self._deferred.append((p, view))
        return True

    def _make_ready(self, p: torch.Tensor, slot: tuple[Bucket, int]) -> None:
        bucket, i = slot
        self._ready.add(id(p))
        if bucket.flat.is_cuda:
            # The exchange runs on another thread and stream: it waits for the stream that
            # produced (or copied) this gradient, as torch DDP's reducer does.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(bucket.flat.device))
            self._events.setdefault(bucket.index, []).append(event)
        bucket.pending -= 1
        buckets = self.ctx.buckets
        while self._next < len(buckets) and buckets[self._next].pending == 0:
            b = buckets[self._next]
            self._futures.append(self.engine.submit(self._exchange, b,
                                                    self._events.pop(b.index, ())))
            self._next += 1

    def _exchange(self, bucket: Bucket, events: Any) -> Any:
        for event in events:
            event.synchronize()
        tracer = accounting.tracer
        if tracer is None:
            return self.algorithm.on_bucket_ready(self.ctx, bucket)
        t0 = perf_counter()  # the timeline's bucket event covers the exchange's completion
        result = drive(self.algorithm.on_bucket_ready(self.ctx, bucket))
        tracer.span("bucket_exchange", "ddp", t0, perf_counter(),
                    {"bucket": bucket.index, "bytes": bucket.nbytes, "step": self.ctx.step,
                     "algorithm": self.algorithm.name, "group": self.ctx.group.comm.name})
        return result

    def _mark_unused(self, p: torch.Tensor) -> None:
        """Ready without a gradient from this backward: the bucket carries what ``p.grad``
        holds (the no_sync accumulation) or zeros; ``p.grad`` itself stays as it is."""
        bucket, i = self._slots[id(p)]
        self._marked_unused.add(id(p))
        if p.grad is None:
            bucket.views[i].zero_()
        else:
            _bind(p, bucket.views[i])
            if id(p) not in self._used:
                self._saved[id(p)] = p.grad.clone()  # restored if no rank used it
        self._make_ready(p, (bucket, i))

    def _start_backward(self) -> None:
        self._started = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if not self.active:
            return
        if self.mode == FIND_UNUSED and self._reached is not None:
            skip = self._reached
        elif self.mode == STATIC and self._static_unused is not None:
            skip = {id(p) for p in self._params() if id(p) not in self._static_unused}
        else:
            return
        for p in self._params():
            if id(p) not in skip and id(p) not in self._ready:
                self._mark_unused(p)

    def shadow_backward(self) -> None:
        """The collectives of a synced backward with zero gradients, for a rank that has
        run out of data (``join()``): every bucket, the use agreement, the iteration end."""
        self._end_backward(self._shadow_exchange)

    def _shadow_exchange(self) -> None:
        for bucket in self.ctx.buckets:
            bucket.flat.zero_()
        for f in [self.engine.submit(self._exchange, b, ()) for b in self.ctx.buckets]:
            f.result()
        if self.mode == FIND_UNUSED or (self.mode == STATIC and self._static_unused is None):
            self._agree_on_use(self._params())

    def _params(self) -> list[torch.Tensor]:
        return [p for b in self.ctx.buckets for p in b.tensors]

    def _finish_backward(self) -> None:
        self._end_backward(self._finish_exchange)

    def _end_backward(self, exchange: Callable[[], None]) -> None:
        """Finish the buckets' exchange (``exchange``), then ``after_backward`` and the end of
        the iteration; the per-backward state is reset whatever happens."""
        try:
            if self.active:
                exchange()
                if self.grad_scale != 1.0:
                    for bucket in self.ctx.buckets:
                        bucket.flat.mul_(self.grad_scale)
            self.algorithm.after_backward(self.ctx)
            self.ctx.step += 1
            self.on_iteration_end()
        finally:
            self._used = set()
            self._reset_backward()

    def _finish_exchange(self) -> None:
        params = self._params()
        missing = [p for p in params
                   if id(p) not in self._ready and id(p) not in self._marked_unused]
        learning = self.mode == STATIC and self._static_unused is None
        # Every bucket is launched, so every rank makes the same collectives even when
        # parameters are missing here and not on other ranks; missing ones carry what their
        # .grad holds, or zeros.
        for p in missing:
            self._mark_unused(p)
        for f in self._futures:
            f.result()
        for p, view in self._deferred:  # exchanged: the gradients are the bucket's now
            p.grad = view
        self._deferred = []
        if learning:
            self._static_unused = {id(p) for p in missing}
        if self.mode == FIND_UNUSED or learning:
            self._agree_on_use(params)
        elif self._late:
            raise RuntimeError(
                f"commlib.DistributedDataParallel (rank {self.ctx.rank}): parameters "
                f"{self._late[:8]} got gradients although the first iteration (static_graph"
                f"=True) left them unused; the set of used parameters must not change.")
        if missing and self.mode != FIND_UNUSED and not learning:
            names = [self._names.get(id(p), "?") for p in missing]
            hint = ("Pass find_unused_parameters=True if parts of the model are unused in "
                    "some steps (the forward output must depend on every other parameter)."
                    if self.mode == STRICT else
                    "With static_graph=True the set of parameters that get gradients must "
                    "not change after the first iteration.")
            raise RuntimeError(
                f"commlib.DistributedDataParallel (rank {self.ctx.rank}): parameters "
                f"received no gradient in this backward pass: {names[:8]}"
                f"{' ...' if len(names) > 8 else ''}. {hint}")
        if self.mode != STRICT:
            self._restore_globally_unused(params)

    def _agree_on_use(self, params: list[torch.Tensor]) -> None:
        """Allreduce which parameters any rank used since the last exchange, and whether
        any rank saw a gradient arrive for a parameter already marked unused."""
        flags = np.array([id(p) in self._used for p in params] + [bool(self._late)],
                         dtype=np.uint8)
        self.ctx.run(allreduce, flags, ReduceOp.MAX, self.ctx.group)
        if flags[-1]:
            mine = ("\n".join(self._late) or "-").encode()
            late = self.ctx.run(allgather_v, np.frombuffer(mine, dtype=np.uint8),
                                self.ctx.group)
            where = "; ".join(f"rank {r}: {bytes(t).decode().split()}"
                              for r, t in enumerate(late) if bytes(t) != b"-")
            raise RuntimeError(
                f"commlib.DistributedDataParallel (rank {self.ctx.rank}): a gradient arrived "
                f"for a parameter the forward output does not reach, after it had been "
                f"marked unused and its bucket exchanged ({where}). This happens when a "
                f"parameter is used outside forward (a regulariser, a tied head) with "
                f"find_unused_parameters=True; torch DDP raises too. Compute that term "
                f"inside forward, or pass static_graph=True.")
        self._used_globally = flags[:-1].astype(bool)

    def _restore_globally_unused(self, params: list[torch.Tensor]) -> None:
        """Parameters no rank used since the last exchange keep the gradient they had
        (``None`` stays ``None``, a stale gradient is not averaged); the others hold the
        exchanged value."""
        for p, used in zip(params, self._used_globally):
            if used:
                if p.grad is None:
                    bucket, i = self._slots[id(p)]
                    p.grad = bucket.views[i]
            elif id(p) in self._saved:
                p.grad.copy_(self._saved[id(p)])


def _bind(p: torch.Tensor, view: torch.Tensor) -> None:
    """Make ``p.grad`` the bucket view (copying a gradient autograd allocated elsewhere)."""
    grad = p.grad
    if grad is not None and grad.data_ptr() != view.data_ptr():
        view.copy_(grad)
        p.grad = view
