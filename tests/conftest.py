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


@pytest.fixture(scope="module")
def torch_groups():
    """(commlib process group, gloo process group), both over all ranks, for the torch
    backend's tests. When no default group exists yet, the default group is the commlib one
    (made on a port rank 0 chooses) and is destroyed after the module; when another module
    already made a default group (the gloo oracle of the DDP tests), both are new groups
    beside it, destroyed after the module."""
    import numpy as np
    import torch.distributed as dist

    import commlib
    from commlib.mpi.mpi_env import free_port
    owned = not dist.is_initialized()
    if owned:
        port = commlib.broadcast(np.array([free_port() if commlib.get_rank() == 0 else 0]))
        dist.init_process_group("commlib", init_method=f"tcp://127.0.0.1:{int(port[0])}",
                                rank=commlib.get_rank(), world_size=commlib.get_world_size())
        world = dist.group.WORLD
    else:
        world = dist.new_group(backend="commlib")
    assert dist.get_backend(world) == "commlib"
    gloo = dist.new_group(backend="gloo")
    yield world, gloo
    if owned:
        dist.destroy_process_group()
    else:
        dist.destroy_process_group(gloo)
        dist.destroy_process_group(world)
    commlib.barrier()


@pytest.fixture
def commlib_pg(torch_groups):
    """The commlib process group of :func:`torch_groups`."""
    return torch_groups[0]


def pytest_runtest_logreport(report):
    """In a multi-rank run, a failure's report goes to stderr at once, naming the rank: pytest
    prints failures only at the end of the session, and a job that a failure leaves stuck
    (a peer waiting in a collective) ends by the watchdog's abort, which takes the report
    with it."""
    if not report.failed or "mpi4py.MPI" not in sys.modules:
        return
    comm = sys.modules["mpi4py.MPI"].COMM_WORLD
    if comm.Get_size() < 2:
        return
    text = getattr(report, "longreprtext", "") or str(report.longrepr)
    sys.stderr.write(f"\n[rank {comm.Get_rank()} of {comm.Get_size()}] FAILED {report.nodeid} "
                     f"({report.when}):\n{text[-6000:]}\n")
    sys.stderr.flush()


def pytest_unconfigure(config):
    """Open MPI 5's singleton leaves its ``sm_segment`` file in /dev/shm after a normal
    ``MPI_Finalize`` (plain mpi4py, measured: one file per singleton). commlib's import
    releases it in every process that imports commlib; pytest-xdist's controller never
    does, while pytest-mpi initializes MPI in it: release what this process maps (the
    files of this process only, see commlib.mpi.shm)."""
    if "mpi4py.MPI" in sys.modules and "commlib" not in sys.modules:
        try:
            if sys.modules["mpi4py.MPI"].Is_initialized():
                from commlib.mpi.shm import release
                release()
        except Exception:  # noqa: BLE001 - cleanup at the end of the session
            pass
