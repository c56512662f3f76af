"""Numba's pool is sized to a rank's share of the node's cores from the launcher's variables."""
import sys

from commlib.kernels import _threads


def test_share_of_the_cores_from_the_launcher(monkeypatch):
    monkeypatch.setattr(_threads, "cores", lambda: 16)
    monkeypatch.delitem(sys.modules, "numba", raising=False)
    env = {"MPI_LOCALNRANKS": "4"}
    assert _threads.configure(env) == 4 and env["NUMBA_NUM_THREADS"] == "4"
    env = {"OMPI_COMM_WORLD_LOCAL_SIZE": "32"}
    assert _threads.configure(env) == 1 and env["NUMBA_NUM_THREADS"] == "1"
    env = {"SLURM_NTASKS_PER_NODE": "8(x2)"}
    assert _threads.configure(env) == 2


def test_user_choice_and_plain_runs_are_left_alone(monkeypatch):
    monkeypatch.delitem(sys.modules, "numba", raising=False)
    env = {"MPI_LOCALNRANKS": "4", "NUMBA_NUM_THREADS": "3"}
    assert _threads.configure(env) is None and env["NUMBA_NUM_THREADS"] == "3"
    env = {}
    assert _threads.configure(env) is None and "NUMBA_NUM_THREADS" not in env


def test_too_late_once_numba_is_imported():
    import numba  # noqa: F401
    env = {"MPI_LOCALNRANKS": "2"}
    assert _threads.configure(env) is None
