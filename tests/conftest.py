"""Test configuration shared by serial and multi-rank runs.

Multi-rank tests are marked ``mpi`` and run under ``mpiexec -n N python -m pytest
--with-mpi`` (pytest-mpi). A short watchdog deadline makes a desynchronized or deadlocked
run abort in seconds instead of hanging CI.
"""
import os
import sys

os.environ.setdefault("COMMLIB_TIMEOUT", "120")
sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread_per_rank():
    """Ranks share the machine's cores: one torch thread each avoids oversubscription."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def torch_groups():
    """(commlib world process group, gloo process group over the same ranks) of
    torch.distributed, for the torch backend's tests. Under ``mpiexec`` the env://
    variables come from ``import commlib`` (commlib.mpi_env); in the one-rank session there
    are none, so a one-process group is made on a free local port."""
    import commlib
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
