"""The facts commlib needs about one MPI implementation (see :mod:`commlib.mpi.mpi_impl`)."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Implementation:
    """One MPI implementation as commlib uses it. Instances are made by
    :func:`commlib.mpi.mpi_impl.identify` from ``MPI_Get_library_version``'s text.

    Each field says what differs from the others; the code that depends on it reads it here
    instead of assuming one implementation.
    """

    #: Short key: ``"mpich"``, ``"openmpi"``, ``"intel"``, ``"unknown"``.
    key: str = "unknown"
    #: Human name, e.g. ``"Open MPI"``.
    name: str = "unknown MPI"
    #: The version, e.g. ``"5.0.11"`` (empty when not found).
    version: str = ""
    #: The ABI family: ``"mpich"`` (MPICH, Intel MPI, Cray MPICH, MVAPICH) or ``"openmpi"``.
    abi: str = "unknown"
    #: Name prefixes (basenames) of the shared-memory files the implementation creates in
    #: ``/dev/shm`` and leaves behind when a job does not finalize (:mod:`commlib.mpi.shm`).
    shm_prefixes: tuple[str, ...] = ()
    #: The pip package that ships it as a wheel (``pip install mpi4py <package>``).
    wheel: str = ""
    #: ``mpiexec`` options for more ranks than cores (Open MPI refuses without one).
    oversubscribe_args: tuple[str, ...] = ()
    #: Environment that the launcher needs when run as root (Open MPI refuses root).
    root_env: tuple[tuple[str, str], ...] = ()
    #: ``mpiexec`` options under which a dead rank does not end the whole job (what
    #: fault-tolerant mode needs), or None when the implementation offers none.
    keep_running_args: tuple[str, ...] | None = None
    #: ``mpiexec`` options that make each of ``n`` ranks on this machine a failure domain
    #: of its own (one can die without its launcher daemon ending the others), with
    #: ``{hosts}`` standing for ``127.0.0.1,...,127.0.0.n`` (:meth:`rank_domain_args`);
    #: ``()`` where the launcher needs none, None where it offers no way.
    rank_domains: tuple[str, ...] | None = None
    #: How fault-tolerant mode learns of dead ranks and interrupts the survivors
    #: (:mod:`commlib.fault.ft_backend`): ``"pmi"`` (commlib's own: peers of this machine by
    #: process id, the others from the launcher's PMI list of dead processes),
    #: ``"local"`` (commlib's own, peers of this machine only: the launcher reports no
    #: death), ``"ulfm"`` (the MPI library's User-Level Failure Mitigation: failure
    #: notification, revoke), or None (refused).
    fault_tolerance: str | None = None
    #: Why fault-tolerant mode is refused (when ``fault_tolerance`` is None), or why it is
    #: refused beyond one machine (``"local"``).
    fault_tolerance_refusal: str = ""
    #: Why ``MPI_Comm_spawn`` cannot be used (replacements in fault-tolerant mode:
    #: ``group.grow``, ``commlib.elastic.run(replace=True)``), "" where it can.
    spawn_refusal: str = ""
    #: What is known to go wrong with a second ``MPI_Comm_spawn`` once a spawned process
    #: died ("" where nothing is): named in the error of a spawn that times out.
    respawn_bug: str = ""
    #: The MPI_T control variable (an MCA parameter) that is true in a job launched with
    #: :attr:`keep_running_args` ("" where the library does not say): fault-tolerant mode
    #: checks it at ``init``.
    keep_running_cvar: str = ""
    #: Whether libmpi's PMI-1 client can be served from a store (torchrun, Kubernetes,
    #: ``srun --mpi=none``: :mod:`commlib.mpi.launch`).
    store_world: bool = False
    #: Why a store-backed world cannot be formed (when ``store_world`` is false).
    store_world_refusal: str = ""
    #: The ``srun --mpi=`` plugins under which Slurm forms this implementation's world.
    slurm_mpi_plugins: tuple[str, ...] = ()
    #: Whether ``MPI_Abort`` waits for the process manager's answer to its PMI ``abort``
    #: (Intel MPI) instead of returning (MPICH): in a store-backed world that answer comes
    #: from a thread of the same process, which mpi4py's ``Comm.Abort`` (holding the GIL)
    #: never lets run, so the calling rank hangs; commlib's own abort path does not call
    #: ``MPI_Abort`` there.
    pmi_abort_waits: bool = False
    #: Whether UCX carries its messages by default (the UCX settings of
    #: :mod:`commlib.mpi.ucx_env` then apply).
    uses_ucx: bool = False
    #: Known defects worked around in commlib, one line each (documentation and
    #: ``commlib-info``).
    known_bugs: tuple[str, ...] = field(default_factory=tuple)
    #: Where ``COMMLIB_SHM=auto`` takes an operation through commlib's shared-memory tier
    #: on this implementation, per operation name (``"allreduce"``...): ``[low, high)``
    #: byte ranges (``high`` None: no bound), measured against this implementation's own
    #: collectives (``benchmarks/bench_collectives.py --shm``). Operations not named keep
    #: :data:`commlib.primitives.node_shm.AUTO_RANGES`' defaults (measured on MPICH).
    shm_auto_ranges: tuple[tuple[str, tuple[tuple[int, int | None], ...]], ...] = ()

    def launch_args(self, n: int, fault_tolerant: bool = False,
                    oversubscribe: bool | None = None,
                    rank_domains: bool = False) -> list[str]:
        """``mpiexec`` options for ``n`` ranks on this machine (``-n n`` last):
        oversubscription when ``n`` exceeds the cores (or ``oversubscribe``), the options
        fault-tolerant mode needs, and (``rank_domains``) those that make each rank a
        failure domain of its own (:meth:`rank_domain_args`). Raises ``ValueError`` when
        fault-tolerant mode is refused on this implementation."""
        args: list[str] = []
        if oversubscribe is None:
            oversubscribe = n > (os.cpu_count() or 1)
        if oversubscribe:
            args += self.oversubscribe_args
        if rank_domains:
            args += self.rank_domain_args(n)
        if fault_tolerant:
            if self.keep_running_args is None or self.fault_tolerance is None:
                raise ValueError(f"fault-tolerant mode is not available on {self.name}: "
                                 f"{self.fault_tolerance_refusal}")
            args += self.keep_running_args
        return args + ["-n", str(n)]

    def rank_domain_args(self, n: int) -> list[str]:
        """``mpiexec`` options under which each of ``n`` ranks on this machine can die
        alone (:attr:`rank_domains`); ``ValueError`` where the launcher offers none."""
        if self.rank_domains is None:
            raise ValueError(f"{self.name}'s launcher cannot make each rank a failure "
                             f"domain of its own")
        hosts = ",".join(f"127.0.0.{i + 1}" for i in range(n))
        return [a.replace("{hosts}", hosts) for a in self.rank_domains]

    def rank_domain_hosts(self, n: int) -> list[str] | None:
        """The host name each of ``n`` ranks has under :meth:`rank_domain_args` (where
        a spawned replacement must go to be placed like the rank it replaces), or None
        when they name no hosts."""
        if not any("{hosts}" in a for a in self.rank_domains or ()):
            return None
        return [f"127.0.0.{i + 1}" for i in range(n)]

    def launch_env(self) -> dict[str, str]:
        """Variables the launcher needs in its environment (e.g. to run as root)."""
        return dict(self.root_env) if hasattr(os, "geteuid") and os.geteuid() == 0 else {}

    def is_segment(self, name: str) -> bool:
        """Whether the ``/dev/shm`` file ``name`` (a basename) is one of this
        implementation's shared-memory segments."""
        return name.startswith(self.shm_prefixes) if self.shm_prefixes else False

    def describe(self) -> str:
        return f"{self.name} {self.version}".strip()


def first_version(text: str) -> str:
    """The first ``N.N[.N...]`` in ``text`` (empty if none)."""
    found = re.search(r"(\d+\.\d+(?:\.\d+)*)", text)
    return found.group(1) if found else ""
