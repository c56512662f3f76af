"""``resnet50``-style constructors of a small CNN (3xHxW images -> ``num_classes``)."""
import torch.nn as nn


class SmallCNN(nn.Module):
    """conv(stride 4)-BN-ReLU-pool, conv-BN-ReLU, global average pool, linear."""

    def __init__(self, num_classes=1000, width=16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 7, stride=4, padding=3, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


def resnet50(num_classes=1000, **kwargs):
    return SmallCNN(num_classes)


resnet18 = resnet34 = resnet101 = resnet50
