"""How each algorithm's state survives a failure in :class:`commlib.elastic.State`
(:data:`POLICIES`: replicated, per rank, or synced where the algorithm's replicas meet),
and what elastic training refuses: the algorithms in :data:`UNSUPPORTED`, FSDP and sharded
embeddings in the model, a ZeRO optimizer that reduces the gradients itself
(:func:`_refuse_sharded`)."""
from __future__ import annotations

from typing import Any

import torch

from ..base.errors import CommError
from . import zero as zero_elastic

# How each algorithm's state survives a failure (see the State docstring).
REPLICATED = "replicated"      # every replica holds the same state at a commit
PER_RANK = "per_rank"          # replicas differ: each restores its own snapshot
SYNCED = "synced"              # replicas equal where the algorithm says (synced_at) only
POLICIES = {"gradient_allreduce": REPLICATED, "bytegrad": REPLICATED,
            "decentralized": PER_RANK, "local_sgd": SYNCED, "diloco": SYNCED,
            "streaming_diloco": PER_RANK, "powersgd": PER_RANK,
            "low_precision_decentralized": PER_RANK, "qadam": PER_RANK,
            "sparseloco": PER_RANK, "muloco": PER_RANK, "demo": PER_RANK}
UNSUPPORTED = {
    "async_model_average": "its background rounds are not tied to steps, so no step can be "
                           "agreed",
    "d_kfac": "its layer assignment and factors are tied to the world size",
    "dp_kfac": "its layer assignment and factors are tied to the world size",
}

#: Why FSDP and sharded embeddings are refused.
SHARDED_REASON = "a shard of its parameters dies with its rank (no replica is kept)"


def _refuse_sharded(model: Any, optimizer: Any) -> None:
    if isinstance(model, torch.nn.Module):
        from ..embedding.module import _ShardedBase
        from ..sharded.fsdp import FullyShardedDataParallel
        for module in model.modules():
            if isinstance(module, (FullyShardedDataParallel, _ShardedBase)):
                raise CommError(f"commlib.elastic.State: {type(module).__name__} is not "
                                f"supported: {SHARDED_REASON}")
    if zero_elastic.is_zero(optimizer) and optimizer.reduce_gradients:
        raise CommError("commlib.elastic.State: a ZeroRedundancyOptimizer with "
                        "reduce_gradients=True is not supported (not tested under failures: "
                        "use it with reduce_gradients=False behind state.wrap(), whose "
                        "gradient_allreduce averages the gradients)")
