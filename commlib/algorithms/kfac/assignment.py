"""Which rank owns (inverts, and in ``dp_kfac`` also builds the factors of) each layer.

Pure functions of the layer shapes and the world size: every rank computes the same
assignment without communicating.
"""
from __future__ import annotations

from collections.abc import Sequence

from .layers import KFACLayer

METHODS = ("greedy", "round_robin")


def inversion_cost(layer: KFACLayer) -> int:
    """Relative cost of inverting the layer's factors: ``d_in^3 + d_out^3``."""
    return layer.d_in ** 3 + layer.d_out ** 3


def assign(layers: Sequence[KFACLayer], world_size: int, method: str = "greedy") -> list[int]:
    """The owner rank of each layer, in layer order.

    ``"greedy"``: layers by decreasing :func:`inversion_cost` (ties: lower layer index
    first), each to the rank with the least cost so far (ties: lower rank), the classic
    longest-processing-time balance. ``"round_robin"``: layer ``i`` to rank ``i % world_size``.
    """
    if world_size < 1:
        raise ValueError(f"assign: world_size must be positive, got {world_size}")
    if method == "round_robin":
        return [layer.index % world_size for layer in layers]
    if method != "greedy":
        raise ValueError(f"assign: method must be one of {METHODS}, got {method!r}")
    owners = [0] * len(layers)
    load = [0] * world_size
    for pos in sorted(range(len(layers)), key=lambda p: (-inversion_cost(layers[p]), p)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[pos] = rank
        load[rank] += inversion_cost(layers[pos])
    return owners
