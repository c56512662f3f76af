"""Model and gradient shapes shared by the benchmarks."""
from __future__ import annotations

import torch
from torch import nn


def resnet18_shapes(classes: int = 1000) -> list[tuple[str, tuple[int, ...]]]:
    """The parameter shapes of torchvision's ResNet-18, in registration order."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("conv1.weight", (64, 3, 7, 7)),
                                                 ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    c_in = 64
    for layer, c_out in enumerate((64, 128, 256, 512), start=1):
        for block in range(2):
            p = f"layer{layer}.{block}"
            first_in = c_in if block == 0 else c_out
            shapes += [(f"{p}.conv1.weight", (c_out, first_in, 3, 3)),
                       (f"{p}.bn1.weight", (c_out,)), (f"{p}.bn1.bias", (c_out,)),
                       (f"{p}.conv2.weight", (c_out, c_out, 3, 3)),
                       (f"{p}.bn2.weight", (c_out,)), (f"{p}.bn2.bias", (c_out,))]
            if block == 0 and first_in != c_out:
                shapes += [(f"{p}.downsample.0.weight", (c_out, first_in, 1, 1)),
                           (f"{p}.downsample.1.weight", (c_out,)),
                           (f"{p}.downsample.1.bias", (c_out,))]
        c_in = c_out
    shapes += [("fc.weight", (classes, 512)), ("fc.bias", (classes,))]
    return shapes


class WideMLP(nn.Module):
    """A fully connected network whose gradient exchange is a large share of the step:
    ``depth`` hidden layers of ``width`` units (about depth * width^2 parameters)."""

    def __init__(self, d_in: int = 784, width: int = 1024, depth: int = 4,
                 classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(d_in if i == 0 else width, width), nn.ReLU()]
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
