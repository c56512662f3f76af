"""Sharded embedding tables with relaxed consistency (a wrapper layer beside ``ddp``).

:class:`ShardedEmbeddingBag` / :class:`ShardedEmbedding` shard a table over a group and
update it row-wise at the owners; ``staleness`` with :class:`PrefetchLoader` (Persia),
:class:`EmbeddingCache` (HET) and :class:`LookaheadLoader` (Bagpipe) relax or schedule the
exchange.
"""
from .cache import EmbeddingCache
from .lookahead import LookaheadLoader
from .module import ShardedEmbedding, ShardedEmbeddingBag
from .optim import RowAdagrad, RowAdam, RowOptimizer, RowSGD
from .prefetch import PrefetchLoader
from .table import ShardTable

__all__ = ["EmbeddingCache", "LookaheadLoader", "PrefetchLoader", "RowAdagrad", "RowAdam",
           "RowOptimizer",
           "RowSGD", "ShardTable", "ShardedEmbedding", "ShardedEmbeddingBag"]
