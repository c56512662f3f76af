"""MPICH (the ``mpich`` wheel; system MPICH builds, MVAPICH and Cray MPICH share its ABI)."""
from __future__ import annotations

import re

from .base import Implementation, first_version


def identify(text: str) -> Implementation | None:
    """MPICH from ``MPI_Get_library_version``'s text (``MPICH Version: 5.0.2 ...``)."""
    if not re.search(r"\bMPICH\b", text) or "Intel" in text:
        return None
    found = re.search(r"MPICH Version:\s*(\S+)", text)
    return Implementation(
        key="mpich", name="MPICH", version=found.group(1) if found else first_version(text),
        abi="mpich", wheel="mpich",
        # ch4's POSIX shared memory: one segment per node and job (commlib.mpi.shm)
        shm_prefixes=("mpich_shm_", "mpich_vci_"),
        oversubscribe_args=(),  # hydra oversubscribes by default (it refuses the flag)
        # hydra's -disable-auto-cleanup: a dead rank's proxy reports it (PMI_dead_processes)
        # instead of ending the job
        keep_running_args=("-disable-auto-cleanup",),
        # hydra's proxy SIGKILLs every rank of its node when one dies of a signal, with
        # or without -disable-auto-cleanup: a proxy per rank, each its own "host"
        rank_domains=("-launcher", "fork", "-hosts", "{hosts}", "-ppn", "1"),
        fault_tolerance="pmi",
        store_world=True,
        slurm_mpi_plugins=("pmi2", "none"),
        uses_ucx=True,
        known_bugs=(
            "MPI_Isendrecv fills the status with a wrong count (5.0.2): commlib posts a "
            "receive and a send instead",
            "ULFM (MPIX_Comm_revoke/shrink/agree) aborts: fault-tolerant mode uses "
            "commlib's own detection and agreement instead",
            "the UCX netmod's completion callbacks do not handle a request that ends with "
            "an error: fault-tolerant mode keeps intra-node messages off UCX's rendezvous "
            "(commlib.mpi.ucx_env)",
            "hydra ends the job when a rank dies with a PMI request in flight: the failure "
            "detector watches same-machine peers through /proc instead",
        ),
    )
