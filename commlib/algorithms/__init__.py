"""Communication algorithms for :class:`commlib.DistributedDataParallel`: the plugin API,
the registry, and the built-in algorithms."""
from .base import GRADIENTS, WEIGHTS, Algorithm, Context
from .buckets import Bucket
from .registry import ENTRY_POINT_GROUP, available, get, register, reload_entry_points

__all__ = ["Algorithm", "Bucket", "Context", "ENTRY_POINT_GROUP", "GRADIENTS", "WEIGHTS",
           "available", "get", "register", "reload_entry_points"]
