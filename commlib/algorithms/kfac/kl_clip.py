"""KL clipping (Ba, Grosse & Martens 2017): scale the preconditioned gradients so that the
step's predicted change of the model distribution stays below ``kl_clip``."""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def inner_products(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """``<v, g>`` of each ``(v, g)`` pair, summed in float64 (pairs are only read)."""
    return [float(torch.sum(v * g, dtype=torch.float64)) for v, g in pairs]


def clip_scale(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], lr: float,
               kl_clip: float | None, grad_scale: float = 1.0) -> float:
    """``min(1, sqrt(kl_clip / |lr^2 * sum <v, g>|))`` over ``(v, g)`` pairs of preconditioned
    and plain gradients (any matching shapes; only read). ``1.0`` when ``kl_clip`` is ``None``
    or the sum is 0. Pairs are summed in the given order, in float64, so ranks that see
    bitwise-identical pairs in the same order get the bitwise-identical scale. Gradients
    of a loss multiplied by ``grad_scale`` (AMP) give ``grad_scale^2`` times the sum, which
    is divided out."""
    if kl_clip is None:
        return 1.0
    total = 0.0
    for vg in inner_products(pairs):
        total += vg
    vg = abs(total) * lr * lr
    if grad_scale != 1.0:
        vg /= grad_scale * grad_scale
    if vg == 0.0:
        return 1.0
    return min(1.0, math.sqrt(kl_clip / vg))


def scale_for(terms: Iterable[tuple[float, float]], kl_clip: float | None,
              grad_scale: float = 1.0) -> float:
    """The clip scale for per-layer learning rates: ``terms`` are ``(<v, g>, lr)`` per
    layer, the predicted change is ``|sum lr^2 <v, g>|`` (divided by ``grad_scale^2``)."""
    if kl_clip is None:
        return 1.0
    total = 0.0
    for vg, lr in terms:
        total += vg * lr * lr
    vg = abs(total)
    if grad_scale != 1.0:
        vg /= grad_scale * grad_scale
    if vg == 0.0:
        return 1.0
    return min(1.0, math.sqrt(kl_clip / vg))
