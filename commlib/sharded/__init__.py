"""Sharded data parallelism (ZeRO stages 1-3): :class:`ZeroRedundancyOptimizer` shards the
optimizer state; :class:`FullyShardedDataParallel` shards gradients and parameters in
flat chunks (PatrickStar-style)."""
from .zero import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
