"""The algorithm plugin API.

An :class:`Algorithm` is configuration (its constructor's keyword arguments) plus hooks
that :class:`commlib.DistributedDataParallel` calls at fixed points of a training step. The
wrapper knows nothing of any particular algorithm; an algorithm never touches MPI, only
commlib's collectives, on ``ctx.group``.

.. not run: a diagram of the hooks' order, not code

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
    with parameters_averaging(ctx): around DistributedDataParallel.average_parameters()
    teardown(ctx)                   when the wrapper is closed

**Saving and resuming.** :meth:`Algorithm.state_dict` returns everything the algorithm
needs to continue exactly where it stopped (the iteration count and whether the last
iteration's ``after_iteration`` is still due, which live in the context, plus what the
subclass keeps: error-feedback residuals, momenta, replicas, factors), as CPU tensors that
``torch.save`` writes; :meth:`Algorithm.load_state_dict` restores it into an algorithm of
the same name, wrapped around the same model with the same buckets, and raises
``ValueError`` naming what differs otherwise. Subclasses override :meth:`Algorithm.save_state`
and :meth:`Algorithm.load_state`.

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

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..primitives.group import Group
from . import state as saved_state
from .buckets import Bucket, build

GRADIENTS = "gradients"
WEIGHTS = "weights"


@dataclass
class Context:
    """What the wrapper shares with its algorithm (the same object for the whole run)."""

    module: torch.nn.Module
    group: Group                     # commlib Group used by every collective of the run
    named_parameters: list[tuple[str, torch.nn.Parameter]]
    bucket_cap_bytes: int | list[int]  # one cap, or one per bucket (the last repeats)
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
    #: the saved state differs between ranks (residuals, replicas, owned layers): it must
    #: be loaded by the rank, and at the world size, that saved it
    per_rank_state: ClassVar[bool] = False
    #: ``on_bucket_ready`` takes buckets whose gradients autograd left where it made them
    #: (``bucket.sources``, ``bucket.deferred`` of them; CPU gradients of a synced backward
    #: only): it reads them through ``bucket.pieces()`` or calls ``bucket.fill()`` first,
    #: and leaves the result in ``bucket.flat`` (each ``p.grad`` is then rebound to its
    #: view). Saves one copy of every gradient per step where the exchange can gather them
    #: itself (:func:`commlib.primitives.allreduce_from`).
    fuses_bucket_copy: bool = False
    _ctx: Context | None = None

    def attach(self, ctx: Context) -> None:
        """Called by the wrapper before :meth:`setup`: the context that
        :meth:`state_dict` and :meth:`load_state_dict` read and write."""
        self._ctx = ctx

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
        """Communication thread: every gradient of ``bucket`` is in ``bucket.flat`` (or, with
        :attr:`fuses_bucket_copy`, in ``bucket.pieces()``). Exchange it (in place, the
        result in ``bucket.flat``) and return ``None`` or the :class:`Work` handles to
        finish."""
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

    def synced_at(self, step: int) -> bool:
        """Whether, right after :meth:`after_iteration` of iteration ``step``, every rank
        holds the same weights and the same algorithm state (:meth:`save_state`): the
        points where a relaxed algorithm's replicas meet (``local_sgd``'s averages,
        ``diloco``'s outer steps). Front-ends may commit there (:mod:`commlib.elastic`).
        Default: ``False`` (not known)."""
        return False

    def regroup(self, saved_rank: int, saved_world_size: int) -> None:
        """Collective over the wrapper's group, on every member, right after
        :meth:`load_state_dict` of a state that this rank saved as rank ``saved_rank`` of a
        group of ``saved_world_size`` ranks, when the group may be another one (a
        front-end's recovery after a failure, :mod:`commlib.elastic`): make what the
        state holds of other ranks (copies of a neighbour's weights, ...) fit the current
        group. Default: nothing."""

    def reset_own_state(self) -> None:
        """Right after :meth:`load_state_dict` of *another* rank's state on a rank that
        takes it as its own (a front-end's newcomer: a joining spare or a replacement,
        :mod:`commlib.elastic`): reset what that state holds of the rank that saved it
        alone (error feedback: what it has not sent yet, which would otherwise be sent
        twice) to what a fresh rank starts with. Default: nothing."""

    def need_reset(self, ctx: Context) -> bool:
        """Checked before each forward; ``True`` makes the wrapper call :meth:`reset` and
        rebuild the buckets (e.g. when a warm-up ends)."""
        return False

    def reset(self, ctx: Context) -> None:
        """Switch phase; buckets are rebuilt right after."""

    @contextlib.contextmanager
    def parameters_averaging(self, ctx: Context) -> Iterator[None]:
        """Main thread, around ``DistributedDataParallel.average_parameters()``: whatever
        the algorithm must settle so that every rank holds the same weights afterwards
        (e.g. pending corrections, background rounds in flight)."""
        yield

    def teardown(self, ctx: Context) -> None:
        """Stop background work; nothing of the algorithm may run afterwards."""

    # -- saving and resuming -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state, to be saved with the model's and the optimizer's: a new dict
        whose tensors are CPU copies (``torch.save`` writes it; later training does not
        change it). Call it between iterations, e.g. after ``optimizer.step()``. Keys:
        ``algorithm`` (name), ``rank``, ``world_size``, ``step`` (iterations completed),
        ``iteration_pending`` and ``state`` (what :meth:`save_state` returns)."""
        ctx = self._context("state_dict")
        return {"algorithm": self.name, "rank": ctx.rank, "world_size": ctx.world_size,
                "step": ctx.step, "iteration_pending": ctx.iteration_pending,
                "state": saved_state.to_cpu(self.save_state(ctx))}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` on every rank (each rank its own when
        :attr:`per_rank_state`), before training resumes; training then continues exactly
        as it would have from where the state was taken. ``ValueError`` naming what
        differs (algorithm, rank, world size, buckets, shapes) leaves the algorithm as it
        was."""
        ctx = self._context("load_state_dict")
        where = f"{self.name}.load_state_dict (rank {ctx.rank})"
        saved_state.check_keys(where, state, ("algorithm", "rank", "world_size", "step",
                                              "iteration_pending", "state"))
        saved_state.check_same(where, "the algorithm", state["algorithm"], self.name)
        if self.per_rank_state:
            saved_state.check_same(where, "the world size", state["world_size"],
                                   ctx.world_size)
            saved_state.check_same(where, "the rank (each rank loads the state it saved)",
                                   state["rank"], ctx.rank)
        self.load_state(ctx, state["state"], where)
        ctx.step = int(state["step"])
        ctx.iteration_pending = bool(state["iteration_pending"])

    def save_state(self, ctx: Context) -> dict[str, Any]:
        """What this algorithm keeps besides the context's counters (default: nothing).
        Tensors may be live buffers: :meth:`state_dict` copies them to the CPU."""
        return {}

    def load_state(self, ctx: Context, state: Mapping[str, Any], where: str) -> None:
        """Restore what :meth:`save_state` returned. Check everything first and raise
        ``ValueError`` (prefixed with ``where``) before changing anything."""
        saved_state.check_same(where, "the saved algorithm state", dict(state), {})

    def _context(self, method: str) -> Context:
        if self._ctx is None:
            raise RuntimeError(f"{self.name}.{method}: the algorithm is not attached to a "
                               f"DistributedDataParallel yet (its state exists once the "
                               f"wrapper is constructed)")
        return self._ctx

    def __repr__(self) -> str:
        config = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({config})"
