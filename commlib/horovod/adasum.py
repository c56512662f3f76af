"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation"), as
Horovod combines two gradients ``a`` and ``b``::

    # not run: a formula, not code
    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient stays 1 when its norm squared is below ``sqrt(DBL_MIN)``), with the dot
product and norms in float64. Horovod reduces ``2^k`` ranks along a binary tree: ranks
``r`` and ``r ^ 1`` first, then the pairs at distance 2, 4, ... Here every rank gathers
every rank's tensor and walks the same tree locally, which gives Horovod's tree for a
power-of-two world and extends it to **any** world size: at each level, a node without a
partner (the last one of an odd count) moves up unchanged. Cost: an allgather (every rank
receives ``n`` tensors) instead of Horovod's vector-halving exchange.
"""
from __future__ import annotations

import math
import sys

import torch

_TINY = math.sqrt(sys.float_info.min)


def pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two tensors of the same shape and floating dtype (a new tensor, the
    inputs' dtype; the arithmetic in float64)."""
    a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
    dot = float(a64 @ b64)
    anorm, bnorm = float(a64 @ a64), float(b64 @ b64)
    acoeff = 1.0 - dot / anorm * 0.5 if anorm >= _TINY else 1.0
    bcoeff = 1.0 - dot / bnorm * 0.5 if bnorm >= _TINY else 1.0
    return (acoeff * a64 + bcoeff * b64).to(a.dtype).view_as(a)


def adasum_combine(tensors: list) -> torch.Tensor:
    """Adasum of ``tensors`` (rank order) along the tree of the module docstring."""
    level = list(tensors)
    while len(level) > 1:
        nxt = [pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0].clone()
