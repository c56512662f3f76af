"""What ``d_kfac`` and ``dp_kfac`` share: hyperparameters, layers, owners, the schedule,
factor capture, KL clipping and writing the preconditioned gradients back.

.. not run: a diagram of the step, not code

Per iteration, on every rank (``step`` = iterations completed before this one)::

    before_forward    arm factor capture iff step % factor_update_steps == 0
    forward/backward  the capture hooks accumulate this rank's batch factor sums
    on_bucket_ready   gradients averaged with allreduce (as in ``gradient_allreduce``)
    after_backward    [factor update] [inverse update iff step % inv_update_steps == 0]
                      precondition, KL-clip, write into p.grad (in place)
    before_optimizer_step   with ``lr=None`` only: the KL clip, with the optimizer's
                      learning rate of each layer, scales p.grad (first step of the
                      iteration only)

Calibration: the ``G`` factors and the KL clip are computed from loss-scaled gradients
(``grad_scaler``, AMP) and from micro-batches whose loss was divided by
``accumulation_steps``; both are undone (``G`` times ``(accumulation_steps / scale)^2``,
the clip's ``<v, g>`` divided by ``scale^2``), so factors and clipping are those of the
plain loss of the whole batch.

Non-finite gradients (a NaN or Inf on any rank: the allreduce spreads it, so every rank
sees it): the step's factors are dropped and nothing else is done, on every rank alike;
the gradients stay non-finite, so ``torch.amp.GradScaler`` skips the step everywhere and
factors and inverses are as if the step never happened.

Subclasses decide where factors and inverses live and what travels (:meth:`_update_factors`,
:meth:`_update_inverses`, :meth:`_preconditioned`).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from ...primitives.finite import all_finite
from ..base import Context
from ..gradient_allreduce import GradientAllReduce
from . import inverses, saving
from .assignment import METHODS as ASSIGNMENTS
from .assignment import assign
from .factors import FactorCapture
from .kl_clip import clip_scale, inner_products, scale_for
from .layers import KFACLayer, find_layers
from .timers import Timers

#: one layer's result of a step: the layer, its preconditioned gradient matrix ``v`` and its
#: averaged gradient matrix ``g`` (``None`` when KL clipping is off), both ``(d_out, d_in)``
Result = tuple[KFACLayer, torch.Tensor, "torch.Tensor | None"]


class KFAC(GradientAllReduce):
    """Base of the K-FAC algorithms. Hyperparameters (all keyword arguments):

    ``damping`` (1e-3): Tikhonov damping ``gamma`` of ``(A kron G + gamma I)^-1``; > 0.
    ``factor_decay`` (0.95): running averages ``F <- decay F + (1 - decay) F_batch``; the first
    update takes ``F_batch`` as is. In [0, 1).
    ``factor_update_steps`` (1), ``inv_update_steps`` (1): factors are updated on steps that
    are multiples of the first, inverses on multiples of the second (step 0 does both).
    ``kl_clip`` (1e-3): KL-clipping bound, ``None`` disables. ``lr`` (``None``): the
    learning rate KL clipping assumes: ``None`` reads it from the optimizer's param group
    of each layer when the optimizer steps (clipping then scales ``p.grad`` in the first
    ``optimizer.step()`` of the iteration, before the update), a float, or a callable
    ``step -> lr`` (``step``: the iteration; clipping then happens in backward).
    ``grad_scaler`` (``None``): the ``torch.amp.GradScaler`` whose scaled loss is
    backpropagated, or a callable returning the current loss scale. ``accumulation_steps``
    (1): backward passes per iteration (under ``no_sync``) whose loss was divided by it.
    ``assignment`` ("greedy"): owners of layers, "greedy" or "round_robin" (see
    :mod:`.assignment`). ``inverse`` ("eigen"): "eigen" (exact damping) or "cholesky" (see
    :mod:`.inverses`). ``hierarchical`` (False): hierarchical gradient allreduce.
    ``comm_dtype`` (None), ``predivide_factor`` (1): the gradient exchange's precision, as
    in ``gradient_allreduce`` (:mod:`commlib.algorithms.precision`).
    """

    #: whether the factors of every captured layer exist from the start (else a layer's
    #: appear at its first factor update)
    holds_every_factor: ClassVar[bool] = False

    def __init__(self, damping: float = 1e-3, factor_decay: float = 0.95,
                 factor_update_steps: int = 1, inv_update_steps: int = 1,
                 kl_clip: float | None = 1e-3,
                 lr: float | Callable[[int], float] | None = None, assignment: str = "greedy",
                 inverse: str = "eigen", hierarchical: bool = False, grad_scaler: Any = None,
                 accumulation_steps: int = 1, comm_dtype: Any = None,
                 predivide_factor: float = 1.0) -> None:
        super().__init__(hierarchical=hierarchical, average=True, comm_dtype=comm_dtype,
                         predivide_factor=predivide_factor)
        self.damping = _positive("damping", damping)
        if not 0.0 <= factor_decay < 1.0:
            raise ValueError(f"{type(self).__name__}: factor_decay must be in [0, 1), "
                             f"got {factor_decay}")
        self.factor_decay = float(factor_decay)
        self.factor_update_steps = _interval("factor_update_steps", factor_update_steps)
        self.inv_update_steps = _interval("inv_update_steps", inv_update_steps)
        self.kl_clip = None if kl_clip is None else _positive("kl_clip", kl_clip)
        self.lr = lr if lr is None or callable(lr) else _positive("lr", lr)
        if grad_scaler is not None and not (hasattr(grad_scaler, "get_scale")
                                            or callable(grad_scaler)):
            raise ValueError(f"K-FAC: grad_scaler must be a torch.amp.GradScaler or a callable "
                             f"returning the loss scale, got {type(grad_scaler).__name__}")
        self.grad_scaler = grad_scaler
        self.accumulation_steps = _interval("accumulation_steps", accumulation_steps)
        self.assignment = _choice("assignment", assignment, ASSIGNMENTS)
        self.inverse = _choice("inverse", inverse, inverses.METHODS)
        self._layers: list[KFACLayer] = []
        self._owners: list[int] = []
        self._rank = 0
        self._timers = Timers()
        self._capture: FactorCapture | None = None
        self._factor_updates = 0
        self._exchange_bytes = 0
        # lr=None: (layer, <v, g>) of the last backward, clipped when the optimizer steps
        self._clip_pending: list[tuple[KFACLayer, float]] | None = None
        self._clip_loss_scale = 1.0

    # -- public --------------------------------------------------------------------------
    def owners(self) -> dict[str, int]:
        """``{layer name: owner rank}`` for every registered layer, in module order."""
        return {layer.name: r for layer, r in zip(self._layers, self._owners)}

    def layer_shapes(self) -> dict[str, tuple[int, int]]:
        """``{layer name: (d_in, d_out)}`` of the gradient matrices (bias column in d_in)."""
        return {layer.name: (layer.d_in, layer.d_out) for layer in self._layers}

    def held_factors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The running ``(A, G)`` this rank holds, by layer name (the tensors themselves)."""
        return {self._layers[i].name: ag for i, ag in self._factor_items()}

    def held_inverses(self) -> dict[str, list[torch.Tensor]]:
        """The inverses this rank holds, by layer name (see :func:`.inverses.inverse_shapes`)."""
        return {self._layers[i].name: inv for i, inv in self._inverse_items()}

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of second-order state on this rank: ``factors`` (running averages),
        ``batch_factors`` (this step's accumulators, largest seen), ``inverses``, and
        ``exchange`` (send and receive buffers of the largest second-order collective seen)."""
        return {"factors": _nbytes(t for _, ag in self._factor_items() for t in ag),
                "batch_factors": self._capture.peak_bytes if self._capture else 0,
                "inverses": _nbytes(t for _, inv in self._inverse_items() for t in inv),
                "exchange": self._exchange_bytes}

    def second_order_bytes(self) -> int:
        """Total of :meth:`memory_breakdown`."""
        return sum(self.memory_breakdown().values())

    def timings(self, reset: bool = False) -> dict[str, dict[str, float]]:
        """Seconds this rank spent per phase (factors, inverses, precondition,
        communication of second-order data), ``{phase: {"wall_s", "cpu_s"}}``."""
        out = self._timers.snapshot()
        if reset:
            self._timers.reset()
        return out

    # -- hooks ---------------------------------------------------------------------------
    def setup(self, ctx: Context) -> None:
        self._layers = find_layers(ctx.module)
        _check_uniform(self._layers)
        self._owners = assign(self._layers, ctx.world_size, self.assignment)
        self._rank = ctx.rank
        self._capture = FactorCapture(self._captured_layers(), self._timers)
        self._allocate(ctx)

    def before_forward(self, ctx: Context) -> None:
        self._capture.armed = ctx.step % self.factor_update_steps == 0

    def after_backward(self, ctx: Context) -> None:
        if not all(all_finite(b.flat) for b in ctx.buckets):  # averaged: same everywhere
            self._capture.clear()
            self._capture.armed = False
            self._clip_pending = None
            return
        loss_scale = self.loss_scale()
        if ctx.step % self.factor_update_steps == 0:
            self._capture.record_peak()
            self._capture.g_scale = (self.accumulation_steps / loss_scale) ** 2
            self._update_factors(ctx, first=self._factor_updates == 0)
            self._factor_updates += 1
            self._capture.clear()
        self._capture.armed = False  # until the next factor step's forward
        if ctx.step % self.inv_update_steps == 0:
            self._update_inverses(ctx)
        results = self._preconditioned(ctx)
        self._clip_pending = None
        if self.kl_clip is not None and self.lr is None:
            for layer, v, _ in results:
                layer.write_grad(v)
            products = inner_products((v, g) for _, v, g in results)
            self._clip_pending = [(r[0], vg) for r, vg in zip(results, products)]
            self._clip_loss_scale = loss_scale
            return
        lr = self.lr(ctx.step) if callable(self.lr) else self.lr
        scale = clip_scale(((v, g) for _, v, g in results), lr, self.kl_clip, loss_scale)
        for layer, v, _ in results:
            layer.write_grad(v if scale == 1.0 else v * scale)

    def before_optimizer_step(self, ctx: Context, optimizer: torch.optim.Optimizer) -> None:
        """``lr=None``: the KL clip of the last backward with the optimizer's learning rate
        of each layer, applied to ``p.grad`` in place (once per iteration)."""
        if self._clip_pending is None:
            return
        pending, self._clip_pending = self._clip_pending, None
        lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
        terms = []
        for layer, vg in pending:
            lr = lr_of.get(id(layer.module.weight))
            if lr is None:
                raise ValueError(f"{type(self).__name__} (rank {ctx.rank}): KL clipping reads "
                                 f"the learning rate of layer {layer.name!r} from the optimizer, "
                                 f"which does not hold its weight; pass lr= to the algorithm")
            terms.append((vg, float(lr)))
        scale = scale_for(terms, self.kl_clip, self._clip_loss_scale)
        if scale != 1.0:
            with torch.no_grad():
                for layer, _ in pending:
                    for p in layer.parameters():
                        if p.grad is not None:
                            p.grad.mul_(scale)

    def loss_scale(self) -> float:
        """The current loss scale of ``grad_scaler`` (1.0 without one)."""
        if self.grad_scaler is None:
            return 1.0
        get = getattr(self.grad_scaler, "get_scale", self.grad_scaler)
        scale = float(get())
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"{type(self).__name__}: grad_scaler gave the loss scale {scale}; "
                             f"it must be positive and finite")
        return scale

    def teardown(self, ctx: Context) -> None:
        if self._capture is not None:
            self._capture.remove()

    # -- saving and resuming -------------------------------------------------------------
    def save_state(self, ctx: Context) -> dict[str, Any]:
        """See :func:`.saving.save`."""
        return saving.save(self)

    def load_state(self, ctx: Context, saved: Mapping[str, Any], where: str) -> None:
        saving.load(self, saved, where)

    # -- for subclasses ------------------------------------------------------------------
    def owned(self) -> list[KFACLayer]:
        """The layers this rank owns, in layer order."""
        return [ly for ly, r in zip(self._layers, self._owners) if r == self._rank]

    def owned_by(self, rank: int) -> list[KFACLayer]:
        return [ly for ly, r in zip(self._layers, self._owners) if r == rank]

    def _plain(self, layer: KFACLayer) -> torch.Tensor | None:
        """The averaged gradient matrix when KL clipping needs it, else ``None``."""
        return layer.grad_matrix() if self.kl_clip is not None else None

    def _note_exchange(self, *tensors: Any) -> None:
        self._exchange_bytes = max(self._exchange_bytes, _nbytes(tensors))

    def _captured_layers(self) -> list[KFACLayer]:
        raise NotImplementedError

    def _allocate(self, ctx: Context) -> None:
        raise NotImplementedError

    def _factor_items(self) -> list[tuple[int, tuple[torch.Tensor, torch.Tensor]]]:
        raise NotImplementedError

    def _inverse_items(self) -> list[tuple[int, list[torch.Tensor]]]:
        raise NotImplementedError

    def _load_factors(self, factors: dict[int, list[torch.Tensor]]) -> None:
        """Replace the held running factors by ``factors`` (checked; by layer index)."""
        raise NotImplementedError

    def _update_factors(self, ctx: Context, first: bool) -> None:
        raise NotImplementedError

    def _update_inverses(self, ctx: Context) -> None:
        raise NotImplementedError

    def _preconditioned(self, ctx: Context) -> list[Result]:
        raise NotImplementedError


def _nbytes(tensors: Any) -> int:
    """Bytes of distinct storages among ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _check_uniform(layers: list[KFACLayer]) -> None:
    kinds = {(ly.module.weight.dtype, ly.module.weight.device) for ly in layers}
    if len(kinds) > 1:
        raise ValueError(f"K-FAC: every Linear/Conv2d layer must have the same dtype and "
                         f"device (their second-order data travels in one buffer), got {kinds}")


def _positive(name: str, value: float) -> float:
    if not value > 0:
        raise ValueError(f"K-FAC: {name} must be positive, got {value}")
    return float(value)


def _interval(name: str, value: int) -> int:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"K-FAC: {name} must be a positive integer, got {value!r}")
    return int(value)


def _choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"K-FAC: {name} must be one of {choices}, got {value!r}")
    return value
