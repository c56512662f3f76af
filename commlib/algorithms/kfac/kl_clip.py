"""KL clipping (Ba, Grosse & Martens 2017): scale the preconditioned gradients so that the
step's predicted change of the model distribution stays below ``kl_clip``."""
from __future__ import annotations

import math
from typing import Iterable

import torch


def clip_scale(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], lr: float,
               kl_clip: float | None) -> float:
    """``min(1, sqrt(kl_clip / |lr^2 * sum <v, g>|))`` over ``(v, g)`` pairs of preconditioned
    and plain gradients (any matching shapes; only read). ``1.0`` when ``kl_clip`` is ``None``
    or the sum is 0. Pairs are summed in the given order, in float64, so ranks that see
    bitwise-identical pairs in the same order get the bitwise-identical scale."""
    if kl_clip is None:
        return 1.0
    total = 0.0
    for v, g in pairs:
        total += float(torch.sum(v * g, dtype=torch.float64))
    vg = abs(total) * lr * lr
    if vg == 0.0:
        return 1.0
    return min(1.0, math.sqrt(kl_clip / vg))
