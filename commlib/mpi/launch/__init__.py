"""A real MPI world from any launcher's environment (torchrun, Kubernetes, Slurm).

Under ``mpiexec`` MPI forms ``COMM_WORLD`` from its launcher's PMI server. A process
started otherwise (``torchrun``, a Kubernetes PyTorchJob, ``srun`` without an MPI plugin,
N processes started by hand) is an MPI singleton: a world of 1 that cannot join the
others. When such a process's environment names a job (see
:mod:`commlib.mpi.launch.environment`), :func:`bootstrap` serves PMI-1 to libmpi itself from
the job's torch ``TCPStore`` before MPI initializes, so ``MPI.COMM_WORLD`` is the whole
job: ranks equal the launcher's ``RANK`` (or ``SLURM_PROCID``), ranks on one host share
memory, and collectives run as under ``mpiexec`` (see :mod:`commlib.mpi.launch.world`).

``import commlib`` calls :func:`bootstrap` first thing, before anything imports
``mpi4py.MPI``. This layer imports only the standard library, ``mpi4py`` (its ``rc``,
then ``mpi4py.MPI`` uninitialized) and, when it forms a world, torch's ``TCPStore``.

``COMMLIB_LAUNCH=auto|mpi|store`` (default ``auto``): ``mpi`` never forms a store-backed
world; ``store`` makes a missing job an error at import.
"""
from __future__ import annotations

import os
from typing import Any

from . import environment
from .environment import Job, NoJob, detect

__all__ = ["Job", "NoJob", "abort", "bootstrap", "current", "detect", "why_not"]

_world: Any = None
_why_not: str | None = None
_done = False


def bootstrap(environ: Any = None) -> Any:
    """Form the store-backed world if this process's environment names a job and it is
    not under an MPI launcher (once per process; later calls return the same answer).
    Returns the :class:`~commlib.mpi.launch.world.StoreWorld`, or None (then
    :func:`why_not` says why). Raises ``commlib.CommError`` when the job's world cannot
    be formed (its store cannot be reached, a rank does not arrive within
    ``COMMLIB_TIMEOUT``), or when ``COMMLIB_LAUNCH=store`` and there is no job."""
    global _world, _why_not, _done
    if _done:
        return _world
    env = os.environ if environ is None else environ
    mode = environment.mode(env)
    try:
        job = detect(env)
    except NoJob as exc:
        _done, _why_not = True, str(exc)
        if mode == "store":
            from ...base.errors import CommError
            raise CommError(f"commlib (COMMLIB_LAUNCH=store): no store-backed MPI world: "
                            f"{exc}") from None
        return None
    if _mpi_initialized():
        _done = True
        _why_not = ("mpi4py.MPI was imported before commlib (MPI is initialized: each "
                    "process is an MPI world of its own); import commlib first")
        if mode == "store":
            from ...base.errors import CommError
            raise CommError(f"commlib (COMMLIB_LAUNCH=store): no store-backed MPI world: "
                            f"{_why_not}")
        return None
    from .world import form
    try:
        _world = form(job, env)
    except Exception as exc:
        from ...base.errors import CommError
        _done, _why_not = True, f"forming the world failed: {exc}"
        raise CommError(
            f"commlib (rank {job.rank} of {job.size}, {job.launcher}): could not form the "
            f"MPI world from the launcher's store at {job.master_addr}:{job.master_port} "
            f"({'torchrun agent' if job.use_agent_store else 'hosted by rank 0'}): "
            f"{type(exc).__name__}: {exc}") from exc
    _done = True
    return _world


def _mpi_initialized() -> bool:
    import sys
    module = sys.modules.get("mpi4py.MPI")
    return module is not None and module.Is_initialized()


def current() -> Any:
    """The store-backed world this process formed, or None (mpiexec, singleton)."""
    return _world


def abort(exit_code: int) -> None:
    """In a store-backed world, tell the other ranks that this one is aborting the job
    with ``exit_code`` (their monitors then leave with it within a poll, as ``mpiexec``
    would end them); a no-op otherwise. Call it before ``MPI_Abort``: MPICH 5.0's returns
    and leaves the ending to the process manager, which here is a thread of this process
    that a following ``os._exit`` never lets run. Never raises."""
    if _world is not None:
        _world.space.record_abort(exit_code)


def why_not() -> str | None:
    """Why no store-backed world was formed (None if one was, or bootstrap never ran)."""
    return _why_not
