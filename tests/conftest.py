"""Test configuration shared by serial and multi-rank runs.

Multi-rank tests are marked ``mpi`` and run under ``mpiexec -n N python -m pytest
--with-mpi`` (pytest-mpi). A short watchdog deadline makes a desynchronized or deadlocked
run abort in seconds instead of hanging CI.
"""
import os
import sys

os.environ.setdefault("COMMLIB_TIMEOUT", "120")
sys.path.insert(0, os.path.dirname(__file__))
