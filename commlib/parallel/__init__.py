"""Tensor parallelism (Megatron-LM / SplitBrain): sharded Linear layers whose forward and
backward run commlib collectives on the tensor-parallel group, and :func:`shard_model`,
which shards an existing model's memory-heavy Linear layers in place; :func:`auto` builds
the whole dp x pp x tp layout (topology, automatic pipeline stages, sharding) in one call."""
from .auto import AutoParallel, auto
from .layers import ColumnParallelLinear, RowParallelLinear
from .shard import allreduce_gradients, shard_model
from .vocab import VocabParallelEmbedding, parallel_cross_entropy

__all__ = ["AutoParallel", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "allreduce_gradients", "auto", "parallel_cross_entropy", "shard_model"]
