"""``streaming_diloco``: Streaming DiLoCo (Douillard et al., 2025, arXiv 2501.18512), as in
torchft's ``DiLoCo`` with several model fragments: DiLoCo whose outer steps are taken one
fragment at a time, at staggered iterations, each fragment's exchange overlapped with the
inner steps that follow it.

The parameters are split into ``num_fragments`` (F) fragments of whole layers (modules),
contiguous in registration order, the largest as small as possible (:func:`split_layers`). With ``sync_every`` = H (a
multiple of F) and ``fragment_sync_delay`` = tau (< H/F), fragment ``f``:

* at the end of iterations ``t`` with ``(t + tau - f * H / F) % H == 0``: its
  pseudo-gradient ``g_f - x_f`` is taken and its average over the group starts on the
  communication thread (its own communicator), while training goes on;
* tau iterations later, at ``s = t + tau`` (so ``(s - f * H / F) % H == 0``, ``s > 0``):
  the average is awaited, the outer SGD (Nesterov) steps the fragment's global weights
  ``g_f``, and its replica weights become ``(1 - alpha) * g_f + alpha * x_f`` with ``x_f``
  the weights after the tau overlapped inner steps, ``alpha`` = ``fragment_update_alpha``
  (torchft's merge; ``alpha = 0``: the tau local steps of the fragment are dropped).

Every fragment is synchronized once per H iterations, so the total bytes are DiLoCo's
(``1/H`` of ``gradient_allreduce``'s) and the peak per iteration is one fragment: ``1/F``
of DiLoCo's. With ``quantize="int8"`` the pseudo-gradients travel through the compressed
allreduce (min-max uint8 kernels, CPU and CUDA; two quantizations per exchange): about
``1/4`` of the bytes again. ``quantize="int4"``: 4-bit min-max codes
(:mod:`commlib.algorithms.int4`), about ``1/8`` (``1/(8H)`` of synchronous in total).

Error feedback: the paper quantizes the outer gradients (to 4-bit floats) *without*
error feedback and reports no loss from it; that is the default here
(``error_feedback=False``). ``error_feedback=True`` keeps, per fragment, this rank's
quantization error of its own contribution and adds it to the next pseudo-gradient of
the fragment.

State (:meth:`state_dict`): the global weights and outer momentum (the same on every rank)
and, per rank, the replica weights of an exchange in flight and the error-feedback
residuals; a state is taken between iterations and resumes exactly, also with an
exchange in flight (its average is recomputed on loading). Non-finite pseudo-gradients
raise :class:`~commlib.base.errors.NonFiniteError` on every rank as in ``diloco``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import torch

from ..base.reduce_ops import ReduceOp
from ..primitives import allreduce, compressed_allreduce, new_group
from ..primitives.compressed import release_workspaces
from . import int4, state
from .base import Context
from .buckets import Bucket, build, pack
from .diloco import DiLoCo
from .registry import register

QUANTIZE = (None, "int8", "int4")
CHUNK = 2048   # elements per quantization chunk (its own min and max)


def split_layers(named: list[tuple[str, torch.Tensor]], parts: int) -> list[list[int]]:
    """Indices of ``named`` (registration order) in ``parts`` contiguous groups of whole
    layers (parameters sharing a module prefix) whose largest element count is the
    smallest possible (the peak bytes of a fragment's exchange)."""
    def owner(name: str) -> str:
        return name.rsplit(".", 1)[0] if "." in name else name

    layers: list[list[int]] = []
    for i, (name, _) in enumerate(named):
        if layers and owner(named[layers[-1][0]][0]) == owner(name):
            layers[-1].append(i)
        else:
            layers.append([i])
    if parts > len(layers):
        raise ValueError(f"streaming_diloco: num_fragments={parts} but the model has only "
                         f"{len(layers)} layers with trainable parameters")
    sizes = [sum(named[i][1].numel() for i in layer) for layer in layers]
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    n, inf = len(layers), float("inf")
    # best[k][i]: the smallest largest part of the first i layers in k parts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(parts, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    return [[t for layer in layers[a:b] for t in layer] for a, b in reversed(bounds)]


@register("streaming_diloco")
class StreamingDiLoCo(DiLoCo):
    """``sync_every`` (H), ``num_fragments`` (F, H a multiple of F),
    ``fragment_sync_delay`` (tau < H/F inner iterations overlapping each exchange),
    ``fragment_update_alpha`` (in [0, 1]), ``quantize`` (``None``, ``"int8"``, ``"int4"``),
    ``error_feedback`` (for ``quantize`` only); the outer SGD as in ``diloco``."""

    per_rank_state = True

    def __init__(self, sync_every: int = 16, num_fragments: int = 2,
                 fragment_sync_delay: int = 0, fragment_update_alpha: float = 0.0,
                 quantize: str | None = None, error_feedback: bool = False,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 outer_nesterov: bool = True) -> None:
        super().__init__(sync_every, outer_lr, outer_momentum, outer_nesterov)
        name = type(self).name
        if isinstance(num_fragments, bool) or int(num_fragments) != num_fragments or \
                num_fragments < 1 or self.sync_every % num_fragments:
            raise ValueError(f"{name}: num_fragments must be an integer >= 1 dividing "
                             f"sync_every={self.sync_every}, got {num_fragments!r}")
        period = self.sync_every // int(num_fragments)
        if int(fragment_sync_delay) != fragment_sync_delay or not \
                0 <= fragment_sync_delay < period:
            raise ValueError(f"{name}: fragment_sync_delay must be an integer in [0, "
                             f"sync_every / num_fragments = {period}), got "
                             f"{fragment_sync_delay!r}")
        if not 0 <= fragment_update_alpha <= 1:
            raise ValueError(f"{name}: fragment_update_alpha must be in [0, 1], got "
                             f"{fragment_update_alpha!r}")
        if quantize not in QUANTIZE:
            raise ValueError(f"{name}: quantize must be one of {QUANTIZE}, got {quantize!r}")
        if error_feedback and quantize is None:
            raise ValueError(f"{name}: error_feedback needs quantize='int8' or 'int4'")
        self.num_fragments = int(num_fragments)
        self.fragment_sync_delay = int(fragment_sync_delay)
        self.fragment_update_alpha = float(fragment_update_alpha)
        self.quantize = quantize
        self.error_feedback = bool(error_feedback)
        self._fragment: list[int] = []            # bucket index -> fragment
        self._group: Any = None
        self._inflight: tuple[int, int, list[torch.Tensor], Future] | None = None
        self._residual: dict[int, torch.Tensor] = {}

    # -- fragments and buckets ----------------------------------------------------------
    def setup(self, ctx: Context) -> None:
        # The exchanges run on their own communicator while the main thread trains.
        self._group = new_group(parent=ctx.group)

    def plan_buckets(self, ctx: Context) -> list[Bucket]:
        named = self.tensors(ctx)
        buckets: list[Bucket] = []
        self._fragment = []
        for f, idx in enumerate(split_layers(named, self.num_fragments)):
            for b in build([named[i] for i in idx], ctx.bucket_cap_bytes):
                buckets.append(Bucket(len(buckets), b.names, b.tensors))
                self._fragment.append(f)
        return buckets

    def fragment_buckets(self, ctx: Context, f: int) -> list[Bucket]:
        return [b for b in ctx.buckets if self._fragment[b.index] == f]

    def _due(self, t: int, shift: int) -> int | None:
        """The fragment whose schedule ``(t + shift - f * H / F) % H == 0`` hits at ``t``."""
        period = self.sync_every // self.num_fragments
        r = (t + shift) % self.sync_every
        return r // period if r % period == 0 else None

    # -- the schedule ---------------------------------------------------------------------
    def synced_at(self, step: int) -> bool:
        """Never for the whole model: the fragments meet the global weights at staggered
        iterations (with one fragment, an exchange in flight or ``fragment_update_alpha``
        leaves replicas apart too)."""
        return False

    def after_iteration(self, ctx: Context) -> None:
        t = ctx.step
        f = self._due(t, self.fragment_sync_delay)
        if f is not None:
            self._launch(ctx, f, t)
        if self._inflight is not None and self._inflight[1] + self.fragment_sync_delay == t:
            self._finish(ctx)

    def _launch(self, ctx: Context, f: int, t: int) -> None:
        buckets = self.fragment_buckets(ctx, f)
        deltas = self.pseudo_gradients(buckets)
        if self.error_feedback:
            for b, d in zip(buckets, deltas):
                if b.index in self._residual:
                    d.add_(self._residual[b.index])
        self._inflight = (f, t, deltas, ctx.submit(self._exchange, buckets, deltas))

    def _exchange(self, buckets: list[Bucket], deltas: list[torch.Tensor]) -> list:
        """Communication thread: average every delta in place; the error-feedback
        residuals (this rank's quantization error of its input) when asked."""
        residuals = []
        for d in deltas:
            sent = d.clone() if self.error_feedback else None
            if self.quantize == "int8":
                compressed_allreduce(d, op=ReduceOp.AVG, group=self._group,
                                     method="minmax_uint8", chunk_size=CHUNK)
            elif self.quantize == "int4":
                int4.allreduce(d, self._group, chunk_size=CHUNK)
            else:
                allreduce(d, op=ReduceOp.AVG, group=self._group)
            if sent is not None:
                residuals.append(sent - self.roundtrip(sent))
        return residuals

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the other ranks decode this rank's contribution (its ``n`` parts
        quantized and dequantized, as the exchange's first phase does)."""
        n = self._group.size
        if self.quantize == "int4":
            return int4.roundtrip(x, CHUNK, n)
        from .. import kernels
        parts = int4._parts(x.detach().reshape(-1).float(), n)
        out = torch.stack([kernels.dequantize_minmax_uint8(
            kernels.quantize_minmax_uint8(row, CHUNK, nonfinite="nan")) for row in parts])
        return out.reshape(-1)[:x.numel()].view(x.shape).to(x.dtype)

    def _finish(self, ctx: Context) -> None:
        f, _, deltas, future = self._inflight
        self._inflight = None
        residuals = future.result()
        buckets = self.fragment_buckets(ctx, f)
        ctx.run(self.check_finite, ctx, buckets, deltas, self._group)
        for b, r in zip(buckets, residuals):
            self._residual[b.index] = r
        local = [pack(b).clone() for b in buckets] if self.fragment_update_alpha else None
        self.outer_step(buckets, deltas)
        for k, b in enumerate(buckets):
            g = self._global[b.index]
            if local is None:
                self.write_weights(b, g)
            else:
                self.write_weights(b, torch.lerp(g.detach(), local[k].to(g.dtype),
                                                 self.fragment_update_alpha))

    def wait_exchange(self) -> None:
        """Wait until the exchange in flight (if any) has finished on this rank; its outer
        step is still taken at its iteration (e.g. so that byte counters read now include
        it)."""
        if self._inflight is not None:
            self._inflight[3].result()

    @contextlib.contextmanager
    def parameters_averaging(self, ctx: Context) -> Iterator[None]:
        """An exchange in flight is finished (its outer step taken) before the average."""
        if self._inflight is not None:
            self._finish(ctx)
        yield

    def teardown(self, ctx: Context) -> None:
        if self._inflight is not None:
            with contextlib.suppress(Exception):
                self._inflight[3].result()
            self._inflight = None
        if self.quantize == "int8":
            ctx.run(release_workspaces)
        if self._group is not None:
            self._group.free()
            self._group = None

    # -- saving and resuming --------------------------------------------------------------
    def save_state(self, ctx: Context) -> dict[str, Any]:
        """DiLoCo's, the residuals and an exchange in flight (waited for: its fragment, the
        iteration it started at, the averaged pseudo-gradients and the new residuals)."""
        out = super().save_state(ctx)
        out["residual"] = [self._residual.get(b.index) for b in ctx.buckets]
        out["inflight"] = None
        if self._inflight is not None:
            f, t, deltas, future = self._inflight
            out["inflight"] = {"fragment": f, "step": t, "averaged": list(deltas),
                               "residual": list(future.result())}
        return out

    def load_state(self, ctx: Context, saved: Mapping[str, Any], where: str) -> None:
        self.check_state(ctx, saved, where, ("residual", "inflight"))
        for b, r in zip(ctx.buckets, saved["residual"]):
            if r is not None:
                state.check_tensor(where, f"the residual of bucket {b.index}", r,
                                   self._global[b.index])
        inflight = saved["inflight"]
        if inflight is not None:
            state.check_keys(where, inflight, ("fragment", "step", "averaged", "residual"))
            if not 0 <= int(inflight["fragment"]) < self.num_fragments:
                raise ValueError(f"{where}: the exchange in flight is of fragment "
                                 f"{inflight['fragment']}, this run has {self.num_fragments}")
            buckets = self.fragment_buckets(ctx, int(inflight["fragment"]))
            for b, d in zip(buckets, inflight["averaged"]):
                state.check_tensor(where, f"the pseudo-gradient in flight of bucket "
                                   f"{b.index}", d, self._global[b.index])
        if self._inflight is not None:   # this run's own exchange: let it end first
            self._inflight[3].result()
            self._inflight = None
        self.restore(saved)
        self._residual = {b.index: state.restore(r, b.flat.device)
                          for b, r in zip(ctx.buckets, saved["residual"]) if r is not None}
        if inflight is not None:
            f = int(inflight["fragment"])
            device = self._global[0].device
            done: Future = Future()
            done.set_result([state.restore(r, device) for r in inflight["residual"]])
            self._inflight = (f, int(inflight["step"]),
                              [state.restore(d, device) for d in inflight["averaged"]], done)
