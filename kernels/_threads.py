"""Size Numba's CPU thread pool to this process's share of the node's cores, before Numba
starts its pool.

Under ``mpiexec`` several ranks share a node. Numba's default pool has one thread per core
in every rank, and its OpenMP threads keep spinning for a while after each parallel
kernel; with ranks outnumbering cores that spinning starved everything else in the rank
(plain torch copies ran 14x slower right after a compression kernel). The launcher tells
each rank how many ranks share its node; unless the user set ``NUMBA_NUM_THREADS``, each
rank gets ``cores // local_ranks`` threads (at least one, which means no pool at all).
"""
from __future__ import annotations

import os
import sys

# Set by the launchers: MPICH/Hydra, Open MPI, MVAPICH, Intel MPI, Slurm.
LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                        "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def local_ranks(environ: dict[str, str] | None = None) -> int | None:
    """Ranks sharing this node according to the launcher, ``None`` outside a launcher."""
    env = os.environ if environ is None else environ
    for var in LOCAL_SIZE_VARIABLES:
        value = env.get(var, "").split("(")[0]  # Slurm may write "4(x2)"
        if value.strip().isdigit() and int(value) > 0:
            return int(value)
    return None


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def configure(environ: dict[str, str] | None = None) -> int | None:
    """Set ``NUMBA_NUM_THREADS`` for this rank if nobody chose it and Numba has not started;
    returns the number set (``None`` when left alone)."""
    env = os.environ if environ is None else environ
    if "NUMBA_NUM_THREADS" in env or "numba" in sys.modules:
        return None
    ranks = local_ranks(env)
    if ranks is None:
        return None
    threads = max(1, cores() // ranks)
    env["NUMBA_NUM_THREADS"] = str(threads)
    return threads
