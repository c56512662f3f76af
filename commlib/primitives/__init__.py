"""Collective primitives over numpy, torch and cupy buffers (one module per collective)."""
from .allgather import allgather, allgather_v
from .allreduce import allreduce
from .alltoall import alltoall
from .barrier import barrier
from .broadcast import broadcast
from .compressed import CompressionState, compressed_allreduce
from .decentralized import (PEER_MODES, compressed_ring_exchange, peer_average,
                            ring_neighbors, shift_one_peer)
from .group import Group, new_group, world
from .p2p import recv, send, sendrecv
from .reduce import reduce
from .reduce_scatter import block_offsets, block_sizes, reduce_scatter
from .work import Work

__all__ = [
    "CompressionState", "Group", "PEER_MODES", "Work", "compressed_allreduce",
    "compressed_ring_exchange", "allgather", "allgather_v", "allreduce", "alltoall",
    "barrier", "block_offsets", "block_sizes", "broadcast", "new_group", "peer_average",
    "recv", "reduce", "reduce_scatter", "ring_neighbors", "send", "sendrecv",
    "shift_one_peer", "world",
]
