"""The layers K-FAC preconditions and the matrix view of their gradients.

A registered layer is an ``nn.Linear`` or an ``nn.Conv2d`` (``groups == 1``) whose weight
requires grad. Its gradient is seen as one matrix of shape ``(d_out, d_in)``:

* ``nn.Linear(i, o)``: ``d_in = i (+1 with bias)``, ``d_out = o``;
* ``nn.Conv2d(c, o, (kh, kw))``: ``d_in = c*kh*kw (+1 with bias)``, ``d_out = o``;

the bias, when present, is the last column. Every other module (batch norm, grouped
convolutions, ...) is not registered and keeps the averaged gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class KFACLayer:
    """One registered layer. ``index`` is its position in module order (0-based)."""

    index: int
    name: str
    module: nn.Module
    d_in: int   # columns of the gradient matrix, bias column included
    d_out: int  # rows of the gradient matrix

    @property
    def has_bias(self) -> bool:
        return self.module.bias is not None

    @property
    def is_conv(self) -> bool:
        return isinstance(self.module, nn.Conv2d)

    @property
    def grad_numel(self) -> int:
        """Elements of the gradient matrix, ``d_out * d_in``."""
        return self.d_out * self.d_in

    def parameters(self) -> list[nn.Parameter]:
        """Weight, then bias when present."""
        return [self.module.weight] + ([self.module.bias] if self.has_bias else [])

    def grad_matrix(self) -> torch.Tensor:
        """A new ``(d_out, d_in)`` tensor ``[W.grad | b.grad]`` (zeros for a missing grad),
        in the weight's dtype and device. Reads ``.grad`` only."""
        cols = [_grad_or_zeros(self.module.weight).reshape(self.d_out, -1)]
        if self.has_bias:
            cols.append(_grad_or_zeros(self.module.bias).reshape(self.d_out, 1))
        return torch.cat(cols, dim=1)

    def write_grad(self, matrix: torch.Tensor) -> None:
        """Copy a ``(d_out, d_in)`` matrix into ``weight.grad`` (and ``bias.grad``) in place,
        so views into the wrapper's gradient buckets stay valid. Parameters whose ``grad`` is
        ``None`` (unused on every rank) keep ``None``."""
        weight, bias = self.module.weight, self.module.bias
        with torch.no_grad():
            if weight.grad is not None:
                weight.grad.copy_(matrix[:, :weight[0].numel()].reshape_as(weight))
            if bias is not None and bias.grad is not None:
                bias.grad.copy_(matrix[:, -1])

    def input_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows ``a`` that build ``A``: ``(rows, d_in)``, one per example and position
        (unfolded patch for a convolution), a column of ones appended with a bias. ``x`` is
        the layer's input (batched or not); the result is a new tensor, ``x`` is untouched."""
        x = x.detach()
        if self.is_conv:
            rows = _patches(x if x.dim() == 4 else x.unsqueeze(0), self.module)
        else:
            rows = x.reshape(-1, x.shape[-1])
        if self.has_bias:
            rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
        return rows

    def output_rows(self, g: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The gradient w.r.t. the layer's output as ``(rows, d_out)`` (one row per example
        and position) and the batch size (first dimension of a batched output, else 1)."""
        g = g.detach()
        if self.is_conv:
            batched = g.dim() == 4
            g = g if batched else g.unsqueeze(0)
            rows = g.flatten(2).transpose(1, 2).reshape(-1, self.d_out)  # (b, h, w) as patches
            return rows, (g.shape[0] if batched else 1)
        return g.reshape(-1, self.d_out), (g.shape[0] if g.dim() > 1 else 1)


def find_layers(module: nn.Module) -> list[KFACLayer]:
    """Every supported layer of ``module``, in ``named_modules()`` order (the same on every
    rank that wraps the same model)."""
    layers: list[KFACLayer] = []
    for name, m in module.named_modules():
        if not _supported(m):
            continue
        bias = 1 if m.bias is not None else 0
        d_in = m.weight[0].numel() + bias
        layers.append(KFACLayer(len(layers), name, m, d_in, m.weight.shape[0]))
    return layers


def _supported(m: nn.Module) -> bool:
    if isinstance(m, nn.Linear):
        return m.weight.requires_grad
    if isinstance(m, nn.Conv2d):
        return m.groups == 1 and m.weight.requires_grad
    return False


def _grad_or_zeros(p: nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _patches(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """``(B*L, C*kh*kw)`` patches of a 4-D input, in the order of ``weight.reshape(o, -1)``.

    Padding is applied the way ``nn.Conv2d`` applies it (string paddings and every
    ``padding_mode``), then ``unfold`` runs without padding.
    """
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    pad = conv._reversed_padding_repeated_twice
    if any(pad):
        x = F.pad(x, pad, mode=mode)
    cols = F.unfold(x, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    return cols.transpose(1, 2).reshape(-1, cols.shape[1])
