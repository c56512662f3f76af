"""The creator torch calls for ``backend="commlib"``, and its registration."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch.distributed as dist

from ..base.errors import CommError
from ..core import runtime
from ..mpi import shutdown
from ..primitives import allgather, group_from_ranks, new_group
from . import BACKEND_NAME, stale_groups
from .process_group import ProcessGroupCommlib


def register() -> None:
    """Register the ``commlib`` backend with torch.distributed (idempotent): CPU and CUDA
    tensors, the extended creator API. The defaults torch picks for a device (gloo for
    CPU, nccl for CUDA) are left as they are: ``commlib`` is used where it is asked for.
    Also arranges for process groups that torch modules keep alive after
    ``destroy_process_group()`` to be freed at exit (:mod:`.stale_groups`)."""
    shutdown.register(stale_groups.RELEASER)
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True,
                                  devices=["cpu", "cuda"])


def create(dist_opts: Any, backend_options: Any = None) -> ProcessGroupCommlib:
    """Build the process group torch asked for (torch calls it on the members only).

    The default group: every MPI rank calls it; torch's rank and world size must be the
    MPI ones (true whenever commlib set RANK/WORLD_SIZE under mpiexec), and all ranks check
    that together before anything else, so a mismatch raises :class:`CommError` everywhere
    instead of hanging. A sub-group (``new_group(ranks, backend="commlib")``): its members
    build a communicator among themselves (:func:`commlib.new_subgroup`); torch's global
    ranks are MPI world ranks. The group's ``timeout`` (``init_process_group``/
    ``new_group``) bounds every wait of its operations (:mod:`.deadlines`).
    """
    rank, size = int(dist_opts.group_rank), int(dist_opts.group_size)
    ranks = [int(r) for r in dist_opts.global_ranks_in_group]
    world = runtime.init()  # raises under torchrun and other launchers without MPI
    if not ranks or ranks == list(range(world.size)) and size == world.size:
        if size != world.size:
            raise CommError(f"torch.distributed commlib backend (rank {rank}): the group has "
                            f"world_size={size} but MPI has {world.size} processes; launch "
                            f"with `mpiexec -n {size} ...` and leave WORLD_SIZE unset (commlib "
                            f"sets it from MPI)")
        seen = allgather(np.array([rank]), None).ravel().tolist()
        if seen != list(range(world.size)):
            raise CommError(f"torch.distributed commlib backend (MPI rank {world.rank}): "
                            f"torch ranks by MPI rank are {seen}; the commlib backend needs "
                            f"torch rank == MPI rank (leave RANK unset: commlib sets it from "
                            f"MPI)")
        group = new_group()
    else:
        me = dist.get_rank()
        if me != world.rank:
            raise CommError(f"torch.distributed commlib backend: this process is torch rank "
                            f"{me} but MPI rank {world.rank}; sub-groups need torch rank == MPI "
                            f"rank (leave RANK unset: commlib sets it from MPI)")
        group = group_from_ranks(ranks)
    return ProcessGroupCommlib(group, rank, size, getattr(dist_opts, "timeout", None))
