"""torch's device-backend autoload entry point: ``init_process_group("commlib")`` in a script
that never imports commlib.

torch 2.x calls the entry points of the group ``torch.backends`` at the end of
``import torch`` (``TORCH_DEVICE_BACKEND_AUTOLOAD``, on by default); commlib's package
metadata names :func:`register` there (``pyproject.toml``). It must stay cheap and
harmless, since it runs in every process that imports torch in this environment
(DataLoader workers, compile workers, tools), MPI job or not. So it lives outside the
``commlib`` package (importing ``commlib`` initializes MPI) and does only this:

* registers the ``commlib`` backend with a creator that imports commlib **when torch
  creates a commlib process group** (the first ``init_process_group("commlib")``), then
  hands over to :func:`commlib.torch_backend.registration.create`; nothing else is
  imported, no MPI is initialized, torch's default backends stay as they are;
* under an MPI launcher (``mpiexec``: ``PMI_SIZE``/``OMPI_COMM_WORLD_SIZE``/... > 1), lets
  ``env://`` rendezvous (the default of ``init_process_group``) import commlib first when
  one of its variables is missing, so that commlib sets ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` from MPI (:mod:`commlib.mpi.mpi_env`)
  instead of torch failing on the missing variables.

It never raises (torch would refuse to import): a failure is a warning. ``import commlib``
registers the backend itself when autoload is off (``TORCH_DEVICE_BACKEND_AUTOLOAD=0``).
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Any

BACKEND_NAME = "commlib"
# The MPI launchers' world-size variables (MPICH/Hydra, Intel MPI, Open MPI, MVAPICH, PMIx).
ENV_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what env:// reads
MPI_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE")


def register() -> None:
    """The entry point torch calls at ``import torch``: register the ``commlib`` backend
    lazily (idempotent; nothing is imported or initialized until the backend is used)."""
    try:
        dist = getattr(sys.modules.get("torch"), "distributed", None)
        if dist is None or not dist.is_available():
            return
        if BACKEND_NAME.upper() not in dist.Backend._plugins:
            # The same registration as commlib.torch_backend.registration.register().
            dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True,
                                          devices=["cpu", "cuda"])
        if under_mpi_launcher(os.environ):
            _wrap_env_rendezvous()
    except Exception as exc:  # noqa: BLE001 - never break `import torch`
        warnings.warn(f"commlib: torch.backends entry point failed: {exc!r}", stacklevel=2)


def create(dist_opts: Any, backend_options: Any = None) -> Any:
    """The backend creator torch calls for a commlib process group: import commlib (which
    forms or joins the MPI world), then build the group as commlib's own creator does."""
    if "commlib" not in sys.modules:
        import torch.distributed as dist
        ranks = list(dist_opts.global_ranks_in_group)
        if ranks and dist.is_initialized() and len(ranks) < dist.get_world_size():
            # Importing commlib is collective over the world; only this group's members
            # are here, so it would hang.
            raise RuntimeError(
                f"init of a commlib sub-group of ranks {ranks}: commlib was never imported "
                f"in this process and its import is collective over every rank; `import "
                f"commlib` (or create the default group with backend='commlib') first")
    import commlib  # noqa: F401 - bootstraps the world, registers exits and hooks
    from commlib.torch_backend.registration import create as commlib_create
    return commlib_create(dist_opts, backend_options)


def under_mpi_launcher(environ: Any) -> bool:
    """Whether an MPI launcher started this process as one of several."""
    for name in MPI_SIZE_VARIABLES:
        try:
            if int(environ.get(name, "1")) > 1:
                return True
        except ValueError:
            continue
    return False


def _wrap_env_rendezvous() -> None:
    import importlib
    rdzv = importlib.import_module("torch.distributed.rendezvous")  # (the attribute is a function)
    original = rdzv._rendezvous_handlers.get("env")
    if original is None or getattr(original, "_commlib", False):
        return

    def env_rendezvous(url: str, *args: Any, **kwargs: Any) -> Any:
        if "commlib" not in sys.modules and not all(os.environ.get(v) for v in ENV_VARIABLES):
            import commlib  # noqa: F401 - sets the env:// variables from MPI (mpi_env)
        return original(url, *args, **kwargs)

    env_rendezvous._commlib = True  # type: ignore[attr-defined]
    env_rendezvous.__wrapped__ = original  # type: ignore[attr-defined]
    rdzv._rendezvous_handlers["env"] = env_rendezvous
