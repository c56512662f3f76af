"""torch.nn modules whose training needs communication across ranks (torch-dependent)."""
from .sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
