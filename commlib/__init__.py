"""commlib: MPI-native collective communication for distributed deep learning.

Launch with ``mpiexec -n N python train.py``. The functional API follows
``torch.distributed``: collectives take numpy arrays, torch tensors (CPU or CUDA) and cupy
arrays, ``group=None`` is the world, and ``async_op=True`` returns a :class:`Work` handle.
"""
# The package's layers, each a folder (see the README's layout): kernels (compute) -> base
# (types, options, buffers) -> mpi (the MPI library, launch, shared memory, watchdog) ->
# fault (detection, agreement) -> core (the world communicator, init, exit paths) ->
# primitives -> services (timeline, topology) -> algorithms -> the front-ends -> run,
# integrations, tools. tests/test_layering.py checks the order.
#
# The modules that once lay flat in this folder keep their names: ``commlib.errors``,
# ``commlib.launch.world`` or ``python -m commlib.selftest`` are the modules below, the
# same objects (sys.modules aliases, made on first import by _FormerNames).
from __future__ import annotations

import importlib as _importlib
import importlib.abc as _abc
import importlib.machinery as _machinery
import importlib.util as _util
import sys as _sys
import typing as _typing

if _typing.TYPE_CHECKING:
    from collections.abc import Sequence
    from types import CodeType, ModuleType

    # what __getattr__ below loads on first use, for type checkers
    from . import algorithms as algorithms
    from . import elastic as elastic
    from . import embedding as embedding
    from . import nn as nn
    from . import parallel as parallel
    from . import pipeline as pipeline
    from .ddp import DistributedDataParallel as DistributedDataParallel
    from .embedding import EmbeddingCache as EmbeddingCache
    from .embedding import LookaheadLoader as LookaheadLoader
    from .embedding import ShardedEmbedding as ShardedEmbedding
    from .embedding import ShardedEmbeddingBag as ShardedEmbeddingBag
    from .services.topology import Grid as Grid
    from .services.topology import Topology as Topology
    from .sharded import FullyShardedDataParallel as FullyShardedDataParallel
    from .sharded import ShardingStrategy as ShardingStrategy
    from .sharded import ZeroRedundancyOptimizer as ZeroRedundancyOptimizer

_MOVED = {
    **{m: "commlib.base." + m for m in ("errors", "options", "accounting", "dtypes",
                                        "reduce_ops", "accelerator", "buffers", "host_views")},
    **{m: "commlib.mpi." + m for m in ("mpi_impl", "launch", "mpi_env", "ucx_env", "shm",
                                       "shutdown", "watchdog")},
    **{m: "commlib.fault." + m for m in ("ft_backend", "failure_detection", "fault_tolerance",
                                         "agreement")},
    **{m: "commlib.core." + m for m in ("communicator", "runtime", "exits")},
    **{m: "commlib.services." + m for m in ("timeline", "topology")},
    **{m: "commlib.tools." + m for m in ("selftest", "info")},
    "hooks": "commlib.ddp.comm_hooks",
}


def _new_name(fullname: str) -> str | None:
    parts = fullname.split(".")
    if len(parts) < 2 or parts[0] != __name__ or parts[1] not in _MOVED:
        return None
    return ".".join([_MOVED[parts[1]], *parts[2:]])


class _FormerNames(_abc.MetaPathFinder, _abc.Loader):
    """``commlib.<former name>[.sub]`` is the module at its new place (the same object)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> _machinery.ModuleSpec | None:
        new = _new_name(fullname)
        real = _util.find_spec(new) if new is not None else None
        if real is None:
            return None
        return _machinery.ModuleSpec(fullname, self, loader_state=new, origin=real.origin,
                                     is_package=real.submodule_search_locations is not None)

    def create_module(self, spec: _machinery.ModuleSpec) -> ModuleType:
        return _importlib.import_module(spec.loader_state)

    def exec_module(self, module: ModuleType) -> None:
        pass

    def get_code(self, fullname: str) -> CodeType:
        # python -m commlib.<former name>: runs the module as __main__ in its own package
        return compile(f"import runpy\nrunpy.run_module({_new_name(fullname)!r}, "
                       "run_name='__main__', alter_sys=True)\n", fullname, "exec")


if not any(isinstance(f, _FormerNames) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _FormerNames())

# First of all, before anything imports mpi4py.MPI: a real MPI world when a launcher that
# is not an MPI launcher (torchrun, Kubernetes, srun) started this process (commlib.mpi.launch).
# Fault-tolerant mode asked for in the environment: no UCX rendezvous inside a machine
# (commlib.mpi.ucx_env).
from .base.options import options as _options  # noqa: E402
from .mpi import mpi_impl as _mpi_impl  # noqa: E402

_mpi_impl.prepare_environment()  # e.g. Open MPI's op=^avx (commlib.mpi.mpi_impl.openmpi)
from .mpi import ucx_env as _ucx_env  # noqa: E402

if _options.fault_tolerant:
    _ucx_env.prepare_fault_tolerant()
from .mpi import launch as _launch  # noqa: E402

_launch.bootstrap()

from . import integrations as _integrations
from .base.accounting import stats
from .base.errors import CommError, NonFiniteError, PeerFailure  # noqa: E402
from .base.options import Options, options
from .base.reduce_ops import ReduceOp
from .core import exits as _exits
from .core.runtime import (
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    init,
    is_initialized,
)
from .mpi import mpi_env as _mpi_env
from .primitives import (
    Group,
    Work,
    allgather,
    allgather_v,
    allreduce,
    alltoall,
    alltoall_v,
    barrier,
    block_offsets,
    block_sizes,
    broadcast,
    gather,
    new_group,
    recv,
    recv_any,
    reduce,
    reduce_scatter,
    scatter,
    send,
    world,
)
from .primitives import group_from_ranks as new_subgroup
from .services import timeline  # noqa: F401 - registers its start at init() (COMMLIB_TIMELINE)
from .torch_backend import hook as _torch_hook

# Under mpiexec: the exit paths armed (an exception aborts the job, a rank that leaves alone
# ends it, MPICH's /dev/shm segments released; see commlib.core.exits), torch.distributed's
# env:// variables from MPI (see commlib.mpi.mpi_env), and the "commlib" torch.distributed
# backend registered once torch is (or when it gets) imported (see
# commlib.torch_backend.hook); none of them imports torch.
_exits.arm_at_import()
_mpi_env.publish()
_torch_hook.install()
_integrations.install()  # Lightning's "commlib" strategy, Accelerate's CPU environment

__version__ = "0.1.0"

# The former names of the modules imported by now, registered before anyone imports them
# (``import commlib.options`` would otherwise set this package's ``options``, the
# instance, to the module).
for _old, _new in _MOVED.items():
    if _new in _sys.modules:
        _sys.modules.setdefault(f"{__name__}.{_old}", _sys.modules[_new])
del _old, _new


def __getattr__(name: str) -> _typing.Any:
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
    if name == "nn":
        return import_module(".nn", __name__)
    if name in _MOVED:  # commlib.hooks, commlib.topology...: the module at its new place
        return import_module(f".{name}", __name__)
    if name in ("Topology", "Grid"):
        return getattr(import_module(".services.topology", __name__), name)
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
