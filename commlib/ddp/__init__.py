"""The DDP wrapper layer."""
from .replicas import RelaxedReplicaWarning, per_rank_state
from .wrapper import DistributedDataParallel

__all__ = ["DistributedDataParallel", "RelaxedReplicaWarning", "per_rank_state"]
