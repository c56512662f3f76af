"""torch.distributed in the test session: one default group of the commlib backend and a
gloo group over the same ranks, shared by the backend's test modules.

Under ``mpiexec`` the env:// variables come from ``import commlib`` (commlib.mpi_env); in
the one-rank session there are none, so a one-process group is made on a free local port.
"""
import os

import pytest

import commlib


@pytest.fixture(scope="session")
def torch_groups():
    """(commlib world process group, gloo world process group)."""
    import torch.distributed as dist
    from commlib.mpi_env import free_port
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group("commlib")
        else:
            dist.init_process_group("commlib", init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1)
    world = dist.group.WORLD
    assert dist.get_backend(world) == "commlib"
    gloo = dist.new_group(backend="gloo")
    yield world, gloo
    dist.destroy_process_group()
    commlib.barrier()
