"""The DDP wrapper layer."""
from .wrapper import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
