"""commlib: MPI-native collective communication for distributed deep learning.

Launch with ``mpiexec -n N python train.py``. The functional API follows
``torch.distributed``: collectives take numpy arrays, torch tensors (CPU or CUDA) and cupy
arrays, ``group=None`` is the world, and ``async_op=True`` returns a :class:`Work` handle.
"""
from .errors import CommError, NonFiniteError
from .options import Options, options
from .primitives import (Group, Work, allgather, allgather_v, allreduce, alltoall, barrier,
                         block_offsets, block_sizes, broadcast, new_group, recv, reduce,
                         reduce_scatter, send, world)
from .reduce_ops import ReduceOp
from .runtime import (get_local_rank, get_local_size, get_rank, get_world_size, init,
                      is_initialized)
from .accounting import stats

__version__ = "0.1.0"


def __getattr__(name: str):
    # torch-dependent layers load on first use, so numpy-only users never import torch.
    from importlib import import_module
    if name == "DistributedDataParallel":
        return import_module(".ddp", __name__).DistributedDataParallel
    if name == "algorithms":
        return import_module(".algorithms", __name__)
    raise AttributeError(f"module 'commlib' has no attribute {name!r}")


__all__ = [
    "CommError", "DistributedDataParallel", "Group", "NonFiniteError", "Options", "ReduceOp", "Work", "allgather", "allgather_v",
    "allreduce", "alltoall", "barrier", "block_offsets", "block_sizes", "broadcast",
    "get_local_rank", "get_local_size", "get_rank", "get_world_size", "init",
    "is_initialized", "new_group", "options", "recv", "reduce", "reduce_scatter", "send",
    "stats", "world",
]
