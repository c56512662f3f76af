"""Tensor parallelism (Megatron-LM / SplitBrain): sharded Linear layers whose forward and
backward run commlib collectives on the tensor-parallel group, and :func:`shard_model`,
which shards an existing model's memory-heavy Linear layers in place."""
from .layers import ColumnParallelLinear, RowParallelLinear
from .shard import allreduce_gradients, shard_model
from .vocab import VocabParallelEmbedding, parallel_cross_entropy

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "allreduce_gradients", "parallel_cross_entropy", "shard_model"]
