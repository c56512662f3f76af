"""Collective primitives over numpy, torch and cupy buffers (one module per collective)."""
from .allgather import allgather, allgather_v
from .allreduce import allreduce
from .alltoall import alltoall
from .barrier import barrier
from .broadcast import broadcast
from .group import Group, new_group, world
from .p2p import recv, send
from .reduce import reduce
from .reduce_scatter import block_offsets, block_sizes, reduce_scatter
from .work import Work

__all__ = [
    "Group", "Work", "allgather", "allgather_v", "allreduce", "alltoall", "barrier",
    "block_offsets", "block_sizes", "broadcast", "new_group", "recv", "reduce",
    "reduce_scatter", "send", "world",
]
