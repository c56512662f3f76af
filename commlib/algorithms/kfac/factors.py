"""Kronecker factors: capture during forward/backward and running averages.

For a layer with rows ``a`` (inputs, see :meth:`KFACLayer.input_rows`) and ``g`` (gradients
w.r.t. its outputs) over ``R`` rows (examples x positions) of a batch of ``B`` examples:

* ``A = sum(a a^T) / R``: the input second moment, averaged over examples and positions;
* ``G = B * sum(g g^T)``: for a loss that is a mean over the ``B`` examples, ``B * g`` is the
  per-example derivative ``ds``, so ``G = sum_i sum_positions ds ds^T / B``: a mean over
  examples, a sum over positions (the KFC convention of Grosse & Martens, 2016).

For one example at one position ``A kron G`` is exactly that example's Fisher block
``vec(dW) vec(dW)^T``; and the mean over ranks of equally sized shards' factors is the
factor of the whole batch, which is what lets ``d_kfac`` average factors with an allreduce.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from .layers import KFACLayer
from .timers import Timers


class FactorCapture:
    """Forward hooks on ``layers`` that, while armed, accumulate each layer's batch sums.

    Only the calling rank's data is seen; nothing is communicated. Several forward passes
    before the next :meth:`clear` (gradient accumulation, shared layers) are averaged. The
    forward hook computes ``A``'s sum and hooks the output tensor; the tensor hook computes
    ``G``'s sum during backward. Calls in ``eval()`` mode or without grad are ignored.
    """

    def __init__(self, layers: Sequence[KFACLayer], timers: Timers) -> None:
        self.layers = list(layers)
        self.timers = timers
        self.armed = False
        self.g_scale = 1.0  # G is multiplied by it (undoes loss scaling and loss / k)
        self.peak_bytes = 0  # largest total of accumulators seen by record_peak
        self._handles = [ly.module.register_forward_hook(partial(self._on_forward, ly))
                         for ly in self.layers]
        self.clear()

    def clear(self) -> None:
        """Forget every accumulated sum (after each factor update)."""
        self._a_sum: dict[int, torch.Tensor] = {}
        self._a_rows: dict[int, int] = {}
        self._g_sum: dict[int, torch.Tensor] = {}
        self._g_calls: dict[int, int] = {}

    def record_peak(self) -> None:
        """Fold the bytes the accumulators hold now into :attr:`peak_bytes`."""
        held = [*self._a_sum.values(), *self._g_sum.values()]
        self.peak_bytes = max(self.peak_bytes, sum(t.nbytes for t in held))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def batch_factor(self, layer: KFACLayer, which: str) -> torch.Tensor | None:
        """This rank's factor ``which`` (``"A"``: ``(d_in, d_in)``, ``"G"``: ``(d_out, d_out)``)
        of the batch since :meth:`clear`, as a new tensor in the layer's dtype; ``None`` if
        the layer took no part in a forward (``A``) or backward (``G``) pass since then.
        ``G`` is multiplied by :attr:`g_scale`."""
        i = layer.index
        if which == "A":
            return self._a_sum[i] / self._a_rows[i] if i in self._a_sum else None
        if i not in self._g_sum:
            return None
        g = self._g_sum[i] / self._g_calls[i]
        return g if self.g_scale == 1.0 else g.mul_(self.g_scale)

    # -- hooks (main thread, inside forward / backward) ----------------------------------
    def _on_forward(self, layer: KFACLayer, module: Any, inputs: tuple, output: Any) -> None:
        if not (self.armed and module.training and torch.is_grad_enabled()):
            return
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        with self.timers.phase("factors"):
            rows = layer.input_rows(inputs[0])
            _accumulate(self._a_sum, layer.index, rows.T @ rows)
            self._a_rows[layer.index] = self._a_rows.get(layer.index, 0) + rows.shape[0]
        output.register_hook(partial(self._on_output_grad, layer))

    def _on_output_grad(self, layer: KFACLayer, grad: torch.Tensor) -> None:
        with self.timers.phase("factors"):
            rows, batch = layer.output_rows(grad)
            _accumulate(self._g_sum, layer.index, (rows.T @ rows).mul_(batch))
            self._g_calls[layer.index] = self._g_calls.get(layer.index, 0) + 1


def _accumulate(sums: dict[int, torch.Tensor], key: int, value: torch.Tensor) -> None:
    if key in sums:
        sums[key].add_(value)
    else:
        sums[key] = value


def update_running(running: torch.Tensor, batch: torch.Tensor, decay: float,
                   first: bool) -> torch.Tensor:
    """In place: ``running <- decay * running + (1 - decay) * batch``; on the ``first``
    update ``running <- batch`` (no bias towards the zero initial value). Returns ``running``."""
    if first:
        return running.copy_(batch)
    return running.mul_(decay).add_(batch, alpha=1.0 - decay)
