"""Test stand-in for torchvision (not installed, no downloads): only what Horovod's
PyTorch examples use; see tests/horovod_examples/README.md."""
from . import datasets, models, transforms  # noqa: F401
