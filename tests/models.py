"""Small models shared by the DDP and algorithm tests."""
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in=10, hidden=32, d_out=4, unused=False):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, d_out)
        self.unused = nn.Linear(hidden, d_out) if unused else None

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class SmallCNN(nn.Module):
    """For 1x8x8 inputs (the scikit-learn digits). Batch norm is optional: its batch
    statistics differ between a rank's slice and the whole batch, so parity tests leave it
    out."""

    def __init__(self, classes=10, bn=False):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6) if bn else nn.Identity()
        self.conv2 = nn.Conv2d(6, 8, 3)
        self.fc = nn.Linear(8 * 3 * 3, classes)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.max_pool2d(x, 2)
        x = torch.relu(self.conv2(x.repeat(1, 1, 2, 2)[:, :, :5, :5]))
        return self.fc(x.flatten(1))


def make(name, dtype, seed=1, **kw):
    torch.manual_seed(seed)
    model = {"mlp": MLP, "cnn": SmallCNN}[name](**kw)
    return model.to(dtype)


def batch(name, n_ranks, per_rank, dtype, step, seed=7):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    total = n_ranks * per_rank
    if name == "mlp":
        x = torch.randn(total, 10, generator=g, dtype=dtype)
        y = torch.randint(0, 4, (total,), generator=g)
    else:
        x = torch.randn(total, 1, 8, 8, generator=g, dtype=dtype)
        y = torch.randint(0, 10, (total,), generator=g)
    return x, y
