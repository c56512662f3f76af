"""scatter: one rank's buffer is cut into blocks, block ``r`` goes to rank ``r``."""
from __future__ import annotations

from typing import Any

from ..base import accounting
from ..base.buffers import adapt
from ..base.errors import where
from ._base import after, blocking, resolve
from .work import Work


def scatter(out: Any, data: Any = None, src: int = 0, group: Any = None,
            async_op: bool = False) -> Any:
    """Receive into ``out`` (in place, every rank) block ``rank`` of ``data`` from rank
    ``src`` (a rank of ``group``).

    ``data`` is read on ``src`` only (pass ``None`` elsewhere): ``group_size`` blocks of
    ``out``'s number of elements, one after the other in memory (for example shape
    ``(group_size, *out.shape)``), of ``out``'s dtype. Every rank passes an ``out`` of the
    same shape and dtype. Returns ``out`` (or a :class:`Work` whose ``wait()`` returns it).
    """
    comm = resolve(group, "scatter")
    rank = comm.rank
    src = comm.check_rank(src, "src", "scatter")
    into = adapt(out, "out", "scatter", rank, write=True, read=False)
    send = None
    bufs = [into]
    if rank == src:
        if data is None:
            raise ValueError(f"{where('scatter', rank)}: argument 'data' is required on the "
                             f"source rank {src}")
        sbuf = adapt(data, "data", "scatter", rank)
        if sbuf.dt is not into.dt or sbuf.count != comm.size * into.count:
            raise ValueError(f"{where('scatter', rank)}: argument 'data' must hold "
                             f"{comm.size} blocks of out's {into.count} elements of "
                             f"{into.dt.name} ({comm.size * into.count} in all), got "
                             f"{sbuf.describe()}")
        send = [sbuf.mem, into.count, sbuf.dt.mpi]
        bufs.append(sbuf)
    comm.seq += 1
    if comm.checking:
        comm.verify("scatter", {"shape": into.shape, "dtype": into.dt.name, "src": src})
    accounting.record("scatter", into.nbytes * comm.size if rank == src else 0, comm.size)
    if async_op:
        request = comm.mpi.Iscatter(send, into.msg(), src)
        return Work(comm, "scatter", into, after(request, *bufs, result=out))
    blocking(comm, "scatter", into, comm.mpi.Scatter, send, into.msg(), src)
    for b in bufs:
        b.finish()
    return out
