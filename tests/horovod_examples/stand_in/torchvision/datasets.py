"""``MNIST``: scikit-learn's 8x8 digits (1797 images) upscaled to 28x28 uint8 (each pixel
3x3, 2 pixels of border), the first 1500 for training and the other 297 for testing."""
import numpy as np
import torch


class MNIST(torch.utils.data.Dataset):
    def __init__(self, root, train=True, transform=None, target_transform=None,
                 download=False):
        from sklearn.datasets import load_digits
        digits = load_digits()
        imgs = np.kron(digits.images, np.ones((3, 3))) * (255.0 / 16.0)
        imgs = np.pad(imgs, ((0, 0), (2, 2), (2, 2))).astype(np.uint8)
        part = slice(0, 1500) if train else slice(1500, None)
        self.data, self.targets = imgs[part], digits.target[part].astype(np.int64)
        self.transform, self.target_transform = transform, target_transform

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        img, target = self.data[i], int(self.targets[i])
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target
