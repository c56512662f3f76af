"""torch.distributed over gloo inside an mpiexec job, as the oracle of differential tests:
a TCPStore rendezvous on a free loopback port that rank 0 chooses and broadcasts through
commlib (a FileStore polls, which made each torch DDP construction take 0.4 s)."""
from __future__ import annotations

import socket

import numpy as np


def gloo_world():
    """Initialize torch.distributed's default group with gloo over the MPI world (once per
    process; collective on first call) and return it."""
    import torch.distributed as dist

    import commlib
    if not dist.is_initialized():
        rank, size = commlib.get_rank(), commlib.get_world_size()
        port = np.zeros(1, dtype=np.int64)
        if rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port[0] = s.getsockname()[1]
        commlib.broadcast(port, 0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port[0])}",
                                rank=rank, world_size=size)
    return dist.group.WORLD
