"""The algorithm plugin API.

An :class:`Algorithm` is configuration (its constructor's keyword arguments) plus hooks
that :class:`commlib.DistributedDataParallel` calls at fixed points of a training step. The
wrapper knows nothing of any particular algorithm; an algorithm never touches MPI, only
commlib's collectives, on ``ctx.group``.

Lifecycle, on every rank, in this order::

    setup(ctx)                      once, after parameters were broadcast from rank 0
    tensors(ctx) / make_buckets()   which tensors travel and how they are grouped
    per iteration (``ctx.step`` = iterations completed before this one):
      after_iteration(ctx)          main thread, once per completed iteration, before the
                                    first training forward of the next one (and before
                                    ``average_parameters()``); ``ctx.step`` already counts
                                    the completed iteration. May communicate.
      need_reset(ctx) -> reset(ctx) checked before each forward (e.g. end of a warm-up);
                                    buckets are rebuilt afterwards
      before_forward(ctx)           main thread, before the module's forward
      on_bucket_ready(ctx, bucket)  communication thread, once per bucket per backward,
                                    buckets in increasing index on every rank
      after_backward(ctx)           main thread, when every bucket exchange finished;
                                    then ``ctx.step`` is incremented
      before_optimizer_step(ctx, optimizer) / after_optimizer_step(ctx, optimizer)
                                    around each ``optimizer.step()`` of an optimizer that
                                    holds parameters of the module: zero, one or several
                                    times per iteration (a skipped AMP step, several
                                    optimizers); rank-local, they must never communicate
    teardown(ctx)                   when the wrapper is closed

**Iterations.** An iteration ends with a backward pass outside ``no_sync()`` (whatever the
algorithm exchanges); ``ctx.step`` counts them. Every rank makes the same backward passes,
so every schedule keyed on ``ctx.step`` (warm-ups, communication intervals, peer
rotations, K-FAC update intervals) agrees across ranks even when one rank skips an
optimizer step or several optimizers step. Work that belongs "after the optimizer step"
and communicates (model averaging, gossip) goes into :meth:`Algorithm.after_iteration`,
which runs once all optimizers of the iteration have stepped.

Hooks that communicate must make the same collectives in the same order on every rank.
``on_bucket_ready`` runs on the wrapper's communication thread, so communication overlaps
with the rest of backward; it may return a :class:`commlib.Work` (or a list of them) that the
thread then drives to completion.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from .buckets import Bucket, build

GRADIENTS = "gradients"
WEIGHTS = "weights"


@dataclass
class Context:
    """What the wrapper shares with its algorithm (the same object for the whole run)."""

    module: torch.nn.Module
    group: Any                       # commlib Group used by every collective of the run
    named_parameters: list[tuple[str, torch.nn.Parameter]]
    bucket_cap_bytes: "int | list[int]"  # one cap, or one per bucket (the last repeats)
    submit: Callable[..., Any]       # run a job on the communication thread -> Future
    buckets: list[Bucket] = field(default_factory=list)
    step: int = 0                    # iterations completed (backward passes outside no_sync)
    iteration_pending: bool = False  # the last one's after_iteration has not run yet
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.size

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the communication thread and wait for its result."""
        return self.submit(fn, *args).result()


class Algorithm:
    """Base class: exchanges nothing. Subclass and override the hooks you need."""

    name: ClassVar[str] = "base"
    #: what ``tensors`` returns by default and what buckets hold
    exchanges: ClassVar[str] = GRADIENTS

    def setup(self, ctx: Context) -> None:
        """Once, after the wrapper broadcast parameters and buffers from rank 0."""

    def tensors(self, ctx: Context) -> list[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs that buckets hold, in registration order. Default: the
        parameters that require grad (their gradients view into the buckets)."""
        return [(n, p) for n, p in ctx.named_parameters if p.requires_grad]

    def make_buckets(self, ctx: Context) -> list[Bucket]:
        """Group :meth:`tensors` into buckets (default: reverse order, ``bucket_cap_mb``)."""
        return build(self.tensors(ctx), ctx.bucket_cap_bytes)

    def before_forward(self, ctx: Context) -> None:
        """Main thread, before each forward."""

    def on_bucket_ready(self, ctx: Context, bucket: Bucket) -> Any:
        """Communication thread: every gradient of ``bucket`` is in ``bucket.flat``.
        Exchange it (in place) and return ``None`` or the :class:`Work` handles to finish."""
        return None

    def after_backward(self, ctx: Context) -> None:
        """Main thread, after every bucket of this backward was exchanged."""

    def before_optimizer_step(self, ctx: Context, optimizer: torch.optim.Optimizer) -> None:
        """Main thread, before ``optimizer.step()`` of an optimizer of the wrapped module."""

    def after_optimizer_step(self, ctx: Context, optimizer: torch.optim.Optimizer) -> None:
        """Main thread, after ``optimizer.step()``."""

    def after_iteration(self, ctx: Context) -> None:
        """Main thread, once per completed iteration, after every optimizer step of it and
        before the next training forward (``ctx.step`` counts the completed iteration).
        Called at the same point on every rank, so it may communicate."""

    def need_reset(self, ctx: Context) -> bool:
        """Checked before each forward; ``True`` makes the wrapper call :meth:`reset` and
        rebuild the buckets (e.g. when a warm-up ends)."""
        return False

    def reset(self, ctx: Context) -> None:
        """Switch phase; buckets are rebuilt right after."""

    def teardown(self, ctx: Context) -> None:
        """Stop background work; nothing of the algorithm may run afterwards."""

    def __repr__(self) -> str:
        config = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({config})"
