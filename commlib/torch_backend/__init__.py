"""torch.distributed over MPI: the ``commlib`` backend of ``torch.distributed``.

``init_process_group(backend="commlib")`` and ``new_group(ranks, backend="commlib")`` run
torch's collectives, point-to-point operations and everything built on them (torch's
``DistributedDataParallel``, ``ZeroRedundancyOptimizer``, ``all_gather_object``...) on
commlib's MPI collectives. The backend is registered as soon as both commlib and torch are
imported, in either order (:mod:`.hook`); under ``mpiexec`` commlib also sets the
``env://`` rendezvous variables at import (:mod:`commlib.mpi.mpi_env`).

Modules: :mod:`.hook` (registration when torch gets imported; imports no torch),
:mod:`.registration` (the creator torch calls), :mod:`.process_group` (collectives),
:mod:`.p2p` (send/recv), :mod:`.work` (handles and futures), :mod:`.convert` (reduce ops,
options), :mod:`.deadlines` (the group's timeout on every wait), :mod:`.profiling`
(``commlib:<op>`` profiler events), :mod:`.sparse` (sparse ``all_reduce``),
:mod:`.monitored` (``monitored_barrier``: which ranks did not arrive). This package's
``__init__`` imports no torch: the attributes below load on use.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

BACKEND_NAME = "commlib"

_LAZY = {
    "ProcessGroupCommlib": ".process_group",
    "commlib_group": ".process_group",
    "monitored_barrier": ".process_group",
    "CommlibWork": ".work",
    "UnsupportedOperation": ".convert",
    "register": ".registration",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'commlib.torch_backend' has no attribute {name!r}")


__all__ = ["BACKEND_NAME", "CommlibWork", "ProcessGroupCommlib", "UnsupportedOperation",
           "commlib_group", "monitored_barrier", "register"]
