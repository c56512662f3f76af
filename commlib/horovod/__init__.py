"""Horovod's PyTorch API on commlib: ``import commlib.horovod as hvd``.

A Horovod script runs unchanged but for its import line, under ``mpiexec -n N python
train.py`` (or ``commlib-horovodrun -np N python train.py``). Named collectives are
negotiated by name as Horovod's coordinator does (:mod:`commlib.horovod.controller`),
``DistributedOptimizer`` exchanges gradients in commlib's buckets during backward
(:mod:`commlib.horovod.optimizer`), with commlib's algorithms one argument away
(``algorithm="bytegrad"``). What differs from Horovod is listed in the user guide's "Coming
from Horovod" page (``docs/guide/horovod.md``).
"""
from . import elastic
from .autograd import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from .basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from .compression import Compression
from .controller import HorovodInternalError, poll, synchronize
from .execute import Adasum, Average, Max, Min, Product, Sum
from .functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from .ops import (
    allgather_async,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    reducescatter_async,
    sparse_allreduce_async,
)
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max",
    "Min", "ProcessSet", "Product", "Sum", "SyncBatchNorm", "add_process_set", "allgather",
    "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "elastic", "gloo_built", "gloo_enabled", "global_process_set", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async", "remove_process_set",
    "rocm_built", "shutdown", "size", "sparse_allreduce_async", "start_timeline",
    "stop_timeline", "synchronize",
]
