"""torch.distributed over gloo inside an mpiexec job, as the oracle of differential tests:
a FileStore rendezvous whose path rank 0 chooses and broadcasts through commlib."""
from __future__ import annotations

import os
import tempfile

import numpy as np


def gloo_world():
    """Initialize torch.distributed's default group with gloo over the MPI world (once per
    process; collective on first call) and return it."""
    import torch.distributed as dist

    import commlib
    if not dist.is_initialized():
        rank, size = commlib.get_rank(), commlib.get_world_size()
        buf = np.zeros(512, dtype=np.uint8)
        if rank == 0:
            path = os.path.join(tempfile.mkdtemp(prefix="commlib-gloo-"), "store").encode()
            buf[:len(path)] = np.frombuffer(path, dtype=np.uint8)
        commlib.broadcast(buf, 0)
        path = bytes(buf).rstrip(b"\0").decode()
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank,
                                world_size=size)
    return dist.group.WORLD
