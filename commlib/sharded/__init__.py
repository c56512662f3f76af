"""Sharded data parallelism (ZeRO stages 1-3): :class:`ZeroRedundancyOptimizer` shards the
optimizer state (stage 1); :class:`FullyShardedDataParallel` shards gradients
(``SHARD_GRAD_OP``, stage 2) and parameters (``FULL_SHARD``, stage 3) in flat chunks
(PatrickStar-style)."""
from .config import MixedPrecision, ShardingStrategy
from .fsdp import FullyShardedDataParallel
from .zero import ZeroRedundancyOptimizer

__all__ = ["FullyShardedDataParallel", "MixedPrecision", "ShardingStrategy",
           "ZeroRedundancyOptimizer"]
