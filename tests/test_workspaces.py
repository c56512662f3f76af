"""The compressed allreduce caches workspaces per thread; algorithms release them when
their wrapper is closed, so constructing and closing wrappers does not grow the memory the
cache holds, even where the exchanges run on a thread that outlives every wrapper (MPI
without ``MPI_THREAD_MULTIPLE``: the main thread)."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")
from helpers import run_mpi, serial_only  # noqa: E402

PROGRAM = os.path.join(os.path.dirname(__file__), "workspace_program.py")


@serial_only
def test_100_construct_close_cycles_hold_no_workspace():
    code, _, out = run_mpi(2, [PROGRAM, "100"], timeout=600, COMMLIB_TIMEOUT="120",
                           MPI4PY_RC_THREAD_LEVEL="serialized", OMP_NUM_THREADS="1")
    assert code == 0, out[-3000:]
    assert out.count("bytes held after each close: [0, 0") == 2, out[-3000:]
