"""Collective primitives over numpy, torch and cupy buffers (one module per collective)."""
from . import ft as _ft  # noqa: F401  (fault-tolerant mode starts at init)
from .allgather import allgather, allgather_v
from .allreduce import allreduce
from .allreduce_from import allreduce_from
from .alltoall import alltoall, alltoall_v
from .barrier import barrier
from .broadcast import broadcast
from .compressed import CompressionState, compressed_allreduce
from .decentralized import (
    PEER_MODES,
    compressed_ring_exchange,
    peer_average,
    ring_neighbors,
    shift_one_peer,
)
from .gather import gather
from .group import Group, group_from_ranks, new_group, world
from .p2p import recv, recv_any, send, sendrecv
from .reduce import reduce
from .reduce_scatter import block_offsets, block_sizes, reduce_scatter
from .scatter import scatter
from .work import Work

__all__ = [
    "CompressionState", "Group", "PEER_MODES", "Work", "compressed_allreduce",
    "compressed_ring_exchange", "allgather", "allgather_v", "allreduce", "allreduce_from",
    "alltoall",
    "alltoall_v", "barrier", "block_offsets", "block_sizes", "broadcast", "gather",
    "group_from_ranks", "new_group", "peer_average", "recv", "recv_any", "reduce",
    "reduce_scatter", "ring_neighbors", "scatter", "send", "sendrecv", "shift_one_peer",
    "world",
]
