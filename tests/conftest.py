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
