"""barrier: no rank leaves before every rank of the group has entered."""
from __future__ import annotations

from typing import Any

from ..base import accounting
from ._base import after, blocking, resolve
from .work import Work


def barrier(group: Any = None, async_op: bool = False) -> Any:
    """Synchronize all ranks of ``group``. Returns ``None`` (or a :class:`Work`)."""
    comm = resolve(group, "barrier")
    comm.seq += 1
    if comm.checking:
        comm.verify("barrier", {})
    accounting.record("barrier", 0, comm.size)
    if async_op:
        return Work(comm, "barrier", "barrier", after(comm.mpi.Ibarrier()))
    blocking(comm, "barrier", "barrier", comm.mpi.Barrier)
    return None
