"""commlib: MPI-native collective communication for distributed deep learning.

Launch with ``mpiexec -n N python train.py``. The functional API follows
``torch.distributed``: collectives take numpy arrays, torch tensors (CPU or CUDA) and cupy
arrays, ``group=None`` is the world, and ``async_op=True`` returns a :class:`Work` handle.
"""
# First of all, before anything imports mpi4py.MPI: a real MPI world when a launcher that
# is not an MPI launcher (torchrun, Kubernetes, srun) started this process (commlib.launch).
# Fault-tolerant mode asked for in the environment: no UCX rendezvous inside a machine
# (commlib.ucx_env).
from .options import options as _options  # noqa: E402
from . import mpi_impl as _mpi_impl  # noqa: E402
_mpi_impl.prepare_environment()  # e.g. Open MPI's op=^avx (commlib.mpi_impl.openmpi)
from . import ucx_env as _ucx_env  # noqa: E402
if _options.fault_tolerant:
    _ucx_env.prepare_fault_tolerant()
from . import launch as _launch  # noqa: E402
_launch.bootstrap()

from .errors import CommError, NonFiniteError, PeerFailure  # noqa: E402
from .options import Options, options
from .primitives import (Group, Work, allgather, allgather_v, allreduce, alltoall, alltoall_v,
                         barrier, block_offsets, block_sizes, broadcast, gather, new_group,
                         recv, recv_any, reduce, reduce_scatter, scatter, send, world)
from .primitives import group_from_ranks as new_subgroup
from .reduce_ops import ReduceOp
from .runtime import (get_local_rank, get_local_size, get_rank, get_world_size, init,
                      is_initialized)
from .accounting import stats
from . import timeline  # registers its start at init() (COMMLIB_TIMELINE)
from . import exits as _exits
from . import mpi_env as _mpi_env
from .torch_backend import hook as _torch_hook
from . import integrations as _integrations

# Under mpiexec: the exit paths armed (an exception aborts the job, a rank that leaves alone
# ends it, MPICH's /dev/shm segments released; see commlib.exits), torch.distributed's
# env:// variables from MPI (see commlib.mpi_env), and the "commlib" torch.distributed
# backend registered once torch is (or when it gets) imported (see
# commlib.torch_backend.hook); none of them imports torch.
_exits.arm_at_import()
_mpi_env.publish()
_torch_hook.install()
_integrations.install()  # Lightning's "commlib" strategy, Accelerate's CPU environment

__version__ = "0.1.0"


def __getattr__(name: str):
    # torch-dependent layers load on first use, so numpy-only users never import torch.
    from importlib import import_module
    if name == "DistributedDataParallel":
        return import_module(".ddp", __name__).DistributedDataParallel
    if name in ("ShardedEmbeddingBag", "ShardedEmbedding", "EmbeddingCache", "LookaheadLoader",
                "embedding"):
        module = import_module(".embedding", __name__)
        return module if name == "embedding" else getattr(module, name)
    if name in ("ZeroRedundancyOptimizer", "FullyShardedDataParallel", "ShardingStrategy"):
        return getattr(import_module(".sharded", __name__), name)
    if name == "algorithms":
        return import_module(".algorithms", __name__)
    if name in ("nn", "hooks"):
        return import_module("." + name, __name__)
    if name in ("Topology", "Grid"):
        return getattr(import_module(".topology", __name__), name)
    if name in ("parallel", "pipeline", "elastic"):
        return import_module(f".{name}", __name__)

    raise AttributeError(f"module 'commlib' has no attribute {name!r}")


__all__ = [
    "CommError", "DistributedDataParallel", "EmbeddingCache", "Grid", "LookaheadLoader",
    "ShardedEmbedding", "ShardedEmbeddingBag", "Group", "NonFiniteError", "Options", "PeerFailure",
    "ReduceOp", "Work", "allgather", "allgather_v",
    "allreduce", "alltoall", "alltoall_v", "barrier", "block_offsets", "block_sizes",
    "broadcast", "gather", "get_local_rank", "get_local_size", "get_rank", "get_world_size",
    "elastic", "init", "is_initialized", "new_group", "new_subgroup", "options", "parallel",
    "pipeline",
    "recv", "recv_any",
    "reduce", "reduce_scatter", "scatter", "send", "stats", "Topology", "world",
    "FullyShardedDataParallel", "ShardingStrategy", "ZeroRedundancyOptimizer",
]
