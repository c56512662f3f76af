"""MPICH's shared-memory segments in ``/dev/shm``, released as soon as they are attached.

MPICH (ch4, POSIX shared memory) creates one segment per node and job,
``/dev/shm/mpich_shm_<id>_<node>`` (``<id>``: FNV-1a hash of the PMI namespace name in hex;
``mpich_vci_<id>_<node>`` too when more than one VCI is in use), in ``MPI_Init``, where every
rank of the node maps it before any rank returns (``MPIDI_POSIX_comm_bootstrap`` waits for
all of them). Only ``MPI_Finalize`` unlinks it. A job that ends any other way (a rank killed,
``MPI_Abort``, ``os._exit``) leaves it behind, and on tmpfs that is memory for good (715 MB
after a few hours of test runs on the CI machine).

:func:`release` unlinks the segments this process maps that still have their name. Once
every rank of the node has mapped a segment its name is not needed any more: the mappings
stay valid, the kernel frees the memory when the last rank exits, however it exits, and
``MPI_Finalize`` ignores that its own unlink finds nothing. commlib calls it once every rank
is past ``MPI_Init`` (at import under an MPI launcher, see :mod:`commlib.exits`; at once in a
singleton, which has a segment of its own too) and again on every path that aborts the job. Only segments this process maps are touched (read from
``/proc/self/maps``, and a name is unlinked only while it still names the mapped file), so
other jobs' segments on the same machine are never affected. Linux only; a no-op elsewhere.
"""
from __future__ import annotations

import os

PREFIXES = ("/dev/shm/mpich_shm_", "/dev/shm/mpich_vci_")
_DELETED = " (deleted)"


def mapped(maps_path: str = "/proc/self/maps") -> list[tuple[str, int, bool]]:
    """``(path, inode, still named)`` of each MPICH segment this process maps."""
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
        if path.startswith(PREFIXES):
            found[path] = (path, int(parts[4]), named)
    return sorted(found.values())


def release(maps_path: str = "/proc/self/maps") -> list[str]:
    """Unlink the MPICH segments this process maps whose names still point at the mapped
    files; return the paths unlinked. Never raises."""
    done = []
    try:
        for path, inode, named in mapped(maps_path):
            if not named:
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
