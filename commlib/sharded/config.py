"""What a :class:`~commlib.sharded.FullyShardedDataParallel` is asked to do, checked
before any communication (so the same ``ValueError``/``TypeError``, naming the argument,
is raised on every rank): the sharding strategy and the mixed-precision policy (torch
FSDP's names), the chunk size and hpZ's ``secondary_shard``. The quantization options
are checked by :func:`commlib.sharded.quantized.quantization_blocks`."""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch


class ShardingStrategy(str, enum.Enum):
    """What is sharded across the ranks (torch FSDP's names)."""
    FULL_SHARD = "FULL_SHARD"          # parameters, gradients, optimizer state (ZeRO-3)
    SHARD_GRAD_OP = "SHARD_GRAD_OP"    # gradients and optimizer state (ZeRO-2)
    NO_SHARD = "NO_SHARD"              # nothing (data parallelism)


@dataclasses.dataclass
class MixedPrecision:
    """torch FSDP's mixed-precision policy (torch's own ``MixedPrecision`` works too).

    ``param_dtype``: the gathered chunks (what forward and backward compute with) and the
    forward inputs; the shards, which the optimizer updates, stay in the parameters' dtype
    (master weights). ``reduce_dtype``: gradients are reduce-scattered in it (default
    ``param_dtype``), then stored in the shards' dtype. ``buffer_dtype``: floating-point
    buffers are cast to it once, at construction."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None


def strategy_of(value: Any, rank: int) -> ShardingStrategy:
    """``value`` (a name, a :class:`ShardingStrategy` or torch's enum) as a strategy."""
    try:
        return ShardingStrategy(getattr(value, "name", value))
    except ValueError:
        raise ValueError(f"FullyShardedDataParallel (rank {rank}): argument "
                         f"'sharding_strategy' must be one of "
                         f"{[s.value for s in ShardingStrategy]}, got {value!r}") from None


def check_layout(strategy: ShardingStrategy, chunk_size_mb: Any, secondary_shard: Any,
                 rank: int) -> None:
    """``chunk_size_mb`` > 0; ``secondary_shard`` None or ``"node"``, the latter with
    FULL_SHARD only."""
    if not chunk_size_mb > 0:
        raise ValueError(f"FullyShardedDataParallel (rank {rank}): argument "
                         f"'chunk_size_mb' must be > 0, got {chunk_size_mb!r}")
    if secondary_shard not in (None, "node"):
        raise ValueError(f"FullyShardedDataParallel (rank {rank}): argument "
                         f"'secondary_shard' must be None or 'node', got "
                         f"{secondary_shard!r}")
    if secondary_shard and strategy is not ShardingStrategy.FULL_SHARD:
        raise ValueError(f"FullyShardedDataParallel (rank {rank}): argument "
                         f"'secondary_shard' needs sharding_strategy FULL_SHARD, got "
                         f"{strategy.value}")


def mixed_precision_dtype(mixed_precision: Any, name: str, rank: int) -> torch.dtype | None:
    """``mixed_precision.<name>`` (torch's ``MixedPrecision`` or commlib's, or a dict)."""
    if mixed_precision is None:
        return None
    value = (mixed_precision.get(name) if isinstance(mixed_precision, dict)
             else getattr(mixed_precision, name, None))
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(f"FullyShardedDataParallel (rank {rank}): mixed_precision.{name} must "
                        f"be a floating-point torch.dtype or None, got {value!r}")
    return value
