"""The MPI library's shared-memory files in ``/dev/shm``, released as soon as every rank of
the node has attached them.

MPI libraries keep their intra-node shared memory in ``/dev/shm`` files that only
``MPI_Finalize`` removes; a job that ends any other way (a rank killed, ``MPI_Abort``,
``os._exit``) leaves them behind, and on tmpfs that is memory for good (715 MB after a few
hours of test runs on the CI machine). Which files, per implementation
(:attr:`commlib.mpi.mpi_impl.Implementation.shm_prefixes`):

* MPICH (ch4, POSIX shared memory): one segment per node and job,
  ``mpich_shm_<id>_<node>`` (``<id>``: FNV-1a hash of the PMI namespace name in hex;
  ``mpich_vci_<id>_<node>`` too when more than one VCI is in use), created in ``MPI_Init``,
  where every rank of the node maps it before any rank returns;
* Open MPI 5 (btl/sm; btl/vader in 4.x): one segment per process,
  ``sm_segment.<host>.<uid>.<jobid>.<rank>``, which the node's other ranks map when they
  first add that process (at ``MPI_Init`` in small jobs);
* Intel MPI unlinks its own files once mapped: nothing to do.

Once every rank of the node has mapped a file its name is not needed any more: the
mappings stay valid, the kernel frees the memory when the last rank exits, however it
exits, and ``MPI_Finalize`` ignores that its own unlink finds nothing. :func:`release_node`
(collective, at import under an MPI launcher, see :mod:`commlib.core.exits`) unlinks the files
that every rank of the node maps; a file some rank has not attached yet keeps its name.
:func:`release` unlinks the files this process maps, on the paths that end the job (an
abort, a stuck exit) and in a singleton. Only files this process maps are touched (read from
``/proc/self/maps``, and a name is unlinked only while it still names the mapped file), so
other jobs' files on the same machine are never affected. Linux only; a no-op elsewhere.
"""
from __future__ import annotations

import os
from typing import Any

_DELETED = " (deleted)"
_DIR = "/dev/shm/"


def prefixes() -> tuple[str, ...]:
    """Paths (``/dev/shm/<prefix>``) of this MPI implementation's segments."""
    try:
        from .mpi_impl import current
        return tuple(_DIR + p for p in current().shm_prefixes)
    except Exception:  # noqa: BLE001 - called on exit paths
        return ()


def mapped(maps_path: str = "/proc/self/maps") -> list[tuple[str, int, bool]]:
    """``(path, inode, still named)`` of each MPI segment this process maps."""
    kinds = prefixes()
    if not kinds:
        return []
    try:
        with open(maps_path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found: dict[str, tuple[str, int, bool]] = {}
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        named = not path.endswith(_DELETED)
        path = path.removesuffix(_DELETED)
        if path.startswith(kinds):
            found[path] = (path, int(parts[4]), named)
    return sorted(found.values())


def release(maps_path: str = "/proc/self/maps", only: Any = None) -> list[str]:
    """Unlink the MPI segments this process maps whose names still point at the mapped
    files (``only``: of those, the paths in it); return the paths unlinked. Never
    raises."""
    done = []
    try:
        for path, inode, named in mapped(maps_path):
            if not named or (only is not None and path not in only):
                continue
            try:
                if os.stat(path).st_ino != inode:
                    continue  # the name is another file's now
                os.unlink(path)
                done.append(path)
            except OSError:
                pass  # another rank of the node was first
    except Exception:  # noqa: BLE001 - called on exit paths: nothing may escape
        pass
    return done


def release_node(comm: Any) -> list[str]:
    """Collective over ``comm`` (an mpi4py intracommunicator; every rank past
    ``MPI_Init``): unlink the segments that every rank of this node (``comm``'s
    shared-memory split) maps. Returns the paths this rank unlinked."""
    from mpi4py import MPI
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        mine = {(p, inode) for p, inode, named in mapped() if named}
        everyone = set.intersection(*local.allgather(mine))
    finally:
        local.Free()
    return release(only={p for p, _ in everyone})
