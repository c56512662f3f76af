"""``Compose``, ``ToTensor`` (HxW uint8 -> 1xHxW float in [0, 1]), ``Normalize``."""
import numpy as np
import torch


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    def __call__(self, pic):
        a = np.asarray(pic, dtype=np.float32) / 255.0
        return torch.from_numpy(a[None] if a.ndim == 2 else a.transpose(2, 0, 1).copy())


class Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, t):
        return (t - self.mean) / self.std
