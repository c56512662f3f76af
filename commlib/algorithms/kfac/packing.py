"""Per-layer tensors packed back to back in one flat buffer, so that one collective moves
the second-order data of many layers."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Shapes = Sequence[tuple[int, ...]]


def packed_numel(shapes_per_layer: Sequence[Shapes]) -> int:
    """Elements of a buffer holding every tensor of every layer."""
    return sum(math.prod(s) for shapes in shapes_per_layer for s in shapes)


def views(flat: torch.Tensor, shapes_per_layer: Sequence[Shapes]) -> list[list[torch.Tensor]]:
    """Split the 1-D ``flat`` into consecutive views shaped ``shapes_per_layer[k][j]``
    (layer ``k``, tensor ``j``). No copy: writing a view writes ``flat``. ``flat`` must have
    exactly :func:`packed_numel` elements."""
    if flat.numel() != packed_numel(shapes_per_layer):
        raise ValueError(f"packed buffer has {flat.numel()} elements, the layout needs "
                         f"{packed_numel(shapes_per_layer)}")
    out, offset = [], 0
    for shapes in shapes_per_layer:
        layer = []
        for shape in shapes:
            n = math.prod(shape)
            layer.append(flat[offset:offset + n].view(shape))
            offset += n
        out.append(layer)
    return out
