"""Deterministic per-rank data and numpy references for the collective tests.

Every rank can compute every other rank's input, so the reference for a collective is a
plain numpy computation on one rank, and assertions hold at any world size.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

NUMPY_DTYPES = ["float16", "float32", "float64", "int32", "int64"]
TORCH_DTYPES = NUMPY_DTYPES + ["bfloat16"]


def require(module: str) -> None:
    """Skip the calling test module when ``module`` is not installed, without importing it
    (``pytest.importorskip`` imports it: lightning costs seconds in every rank of every
    collection, and these modules only need it in the processes they start)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed", allow_module_level=True)


def big_numel(dtype: str) -> int:
    """An element count whose buffer is larger than 1 MiB."""
    itemsize = 2 if dtype in ("float16", "bfloat16") else np.dtype(dtype).itemsize
    return (1 << 20) // itemsize + 7


SIZES = [0, 1, 7, "big"]


def numel_of(size, dtype: str) -> int:
    return big_numel(dtype) if size == "big" else size


def rank_data(rank: int, numel: int, dtype: str, kind: str = "sum", seed: int = 0) -> np.ndarray:
    """Rank ``rank``'s input as float64 values that every dtype represents exactly.

    ``kind="sum"``: small integers, so sums over 4 ranks are exact even in bfloat16;
    ``kind="product"``: values in {-2, -1, 1, 2}, so products stay exact.
    """
    rng = np.random.default_rng(seed * 1000 + rank * 7919 + numel)
    if kind == "product":
        return rng.choice(np.array([-2.0, -1.0, 1.0, 2.0]), size=numel)
    return rng.integers(-8, 9, size=numel).astype(np.float64)


def to_kind(values: np.ndarray, dtype: str, kind: str):
    """Convert float64 values to a numpy array or a CPU torch tensor of ``dtype``."""
    if kind == "numpy":
        return values.astype(dtype)
    import torch
    return torch.tensor(values, dtype=getattr(torch, dtype))


def to_numpy(obj) -> np.ndarray:
    """float64 numpy copy of a numpy array or torch tensor (any dtype, bfloat16 included)."""
    if isinstance(obj, np.ndarray):
        return obj.astype(np.float64)
    return obj.detach().to("cpu").double().numpy()


def tolerance(dtype: str) -> float:
    return {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6}.get(dtype, 1e-12)


def mpi_impl():
    """The MPI implementation under test (:func:`commlib.mpi.mpi_impl.current`)."""
    from commlib.mpi.mpi_impl import current
    return current()


def store_world_refusal() -> str | None:
    """Why the MPI implementation under test cannot be given a world from a store (None
    where it can: MPICH-ABI; Open MPI is refused, tested in test_mpi_impl.py)."""
    impl = mpi_impl()
    return None if impl.store_world else f"{impl.describe()}: {impl.store_world_refusal}"


def requires_store_world(test):
    """Decorator: skip a test of the store-backed world (torchrun, Kubernetes, srun without
    an MPI plugin) where :func:`store_world_refusal` says why it cannot form (checked when
    the test runs: importing this module must not initialize MPI)."""
    import functools

    @functools.wraps(test)
    def run(*args, **kwargs):
        why = store_world_refusal()
        if why:
            pytest.skip(why)
        return test(*args, **kwargs)
    return run


def clean_env(**extra: str | None) -> dict:
    """Environment for a child ``mpiexec``: without this process's MPI/PMI variables, with
    what the implementation's launcher needs (Open MPI's as root); ``extra`` set on top (a
    ``None`` value unsets the variable)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "MPIR_", "HYDRA_", "MPI_", "OMPI_", "PRTE_",
                                "I_MPI_HYDRA_"))}
    env.update(mpi_impl().launch_env())
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def mpiexec() -> str:
    """The ``mpiexec`` of this Python environment (the MPI wheels put it next to python)."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else "mpiexec"


def mpiexec_cmd(n: int, *args: str, fault_tolerant: bool = False) -> list[str]:
    """``[mpiexec, *args, <the implementation's options for n ranks>, -n, n]``
    (oversubscription, fault-tolerant launch: :meth:`commlib.mpi.mpi_impl.Implementation.
    launch_args`); skips the test when fault-tolerant mode is refused on it."""
    try:
        return [mpiexec(), *args, *mpi_impl().launch_args(n, fault_tolerant)]
    except ValueError as exc:
        pytest.skip(str(exc))


def run_mpi(n: int, args: list[str], timeout: float, mpiexec_args: tuple[str, ...] = (),
            **env: str | None) -> tuple[int, float, str]:
    """Run ``mpiexec [mpiexec_args] -n n python args...`` with an outer timeout.

    Returns (exit status, seconds, combined output); a run that outlives ``timeout`` is
    killed with its whole process group and reported as status -9.
    """
    cmd = mpiexec_cmd(n, *mpiexec_args) + [sys.executable] + args
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=clean_env(**env), start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = -9
    return code, time.monotonic() - start, out


def _world_size() -> int:
    if "mpi4py.MPI" not in sys.modules:
        return 1
    return sys.modules["mpi4py.MPI"].COMM_WORLD.Get_size()


# Tests that launch their own mpiexec run in the serial session only.
serial_only = pytest.mark.skipif(_world_size() > 1,
                                 reason="launches its own mpiexec; run in the serial session")


def shm_segments() -> list[str]:
    """The shared-memory files (``/dev/shm/*``: MPICH's ``mpich_*``, Open MPI's
    ``sm_segment.*``, Intel MPI's, torch's) this process maps, by name, whether or not the
    name still exists (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    names = set()
    for line in lines:
        parts = line.split(None, 5)
        path = parts[5].strip() if len(parts) == 6 else ""
        if path.startswith("/dev/shm/"):
            names.add(os.path.basename(path.removesuffix(" (deleted)")))
    return sorted(names)


#: The name the fault programs used before other runtimes were tested.
mpich_segments = shm_segments


def leftover_segments(out: str) -> list[str]:
    """The segments a job's ranks announced (``SHM [names]`` lines, see
    :func:`shm_segments`) that are still in ``/dev/shm``: the job left them behind."""
    import json
    import re
    names = {n for m in re.findall(r"SHM (\[[^\]]*\])", out) for n in json.loads(m)}
    return sorted(n for n in names if os.path.exists(os.path.join("/dev/shm", n)))


def small_window_group(half: int):
    """For a module-scoped fixture (``yield from``): a group over every rank whose node
    window has ``half``-byte halves (made now, while ``node_shm.SEGMENT_BYTES`` says so: a
    few elements take several window steps), freed after the module (window, thread and
    all)."""
    import commlib
    from commlib.primitives import node_shm
    saved = node_shm.SEGMENT_BYTES
    node_shm.SEGMENT_BYTES = half
    g = commlib.new_group()
    try:
        nw = node_shm.window(g.comm) if g.size > 1 else None
    finally:
        node_shm.SEGMENT_BYTES = saved
    assert g.size == 1 or (nw is not None and nw.whole and nw.half_bytes == half)
    yield g
    g.free()
    assert nw is None or (nw.freed and nw.turns._thread is None)
