"""``python -m commlib.tools.info`` / ``commlib-info``: what this installation can do.

Reports the MPI library and version, mpi4py's version, the thread level, whether the MPI
library is CUDA-aware (and how that was decided), which of torch, cupy, numba and
numba.cuda are usable, and, under ``mpiexec``, the rank/node topology.
"""
from __future__ import annotations

import argparse
import json
import platform
import socket
import sys
from typing import Any

THREAD_LEVELS = {0: "MPI_THREAD_SINGLE", 1: "MPI_THREAD_FUNNELED",
                 2: "MPI_THREAD_SERIALIZED", 3: "MPI_THREAD_MULTIPLE"}


def _version(module: str) -> str | None:
    from ..base.accelerator import optional
    mod = optional(module)
    return getattr(mod, "__version__", "installed") if mod is not None else None


def collect() -> dict[str, Any]:
    """This rank's facts, plus the topology of the whole job (collective under mpiexec)."""
    import mpi4py
    from mpi4py import MPI

    from .. import __version__
    from ..base.accelerator import cuda_aware, cuda_usable
    from ..base.options import options
    from ..core import runtime

    world = runtime.world()
    aware, how = cuda_aware(options.cuda_aware)
    level = MPI.Query_thread()
    topology = world.mpi.gather((world.rank, socket.gethostname(),
                                 runtime.get_local_rank(), runtime.get_local_size()), root=0)
    return {
        "commlib": __version__,
        "python": platform.python_version(),
        "mpi_library": " ".join(MPI.Get_library_version().split("\n")[0].split()),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "mpi4py": mpi4py.__version__,
        "thread_level": THREAD_LEVELS.get(level, str(level)),
        "cuda_aware": aware,
        "cuda_aware_decided_by": how,
        "usable": cuda_usable(),
        "versions": {m: _version(m) for m in ("numpy", "torch", "cupy", "numba")},
        "options": options.as_dict(),
        "world_size": world.size,
        "topology": topology,
    }


def render(info: dict[str, Any]) -> str:
    lines = [f"commlib {info['commlib']} on Python {info['python']}",
             f"MPI library     : {info['mpi_library']} (MPI {info['mpi_standard']})",
             f"mpi4py          : {info['mpi4py']}",
             f"thread level    : {info['thread_level']}",
             f"CUDA-aware MPI  : {'yes' if info['cuda_aware'] else 'no'} "
             f"({info['cuda_aware_decided_by']})"]
    for name, ok in info["usable"].items():
        version = info["versions"].get(name.split(".")[0])
        extra = f" {version}" if version and "." not in name else ""
        lines.append(f"{name:<16}: {'usable' if ok else 'not usable'}{extra}")
    lines.append(f"options         : {info['options']}")
    lines.append(f"world size      : {info['world_size']}")
    for rank, host, lrank, lsize in info["topology"] or []:
        lines.append(f"  rank {rank:>3} on {host} (local rank {lrank} of {lsize})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commlib-info", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    info = collect()
    if info["topology"] is not None:  # rank 0 only
        print(json.dumps(info, indent=2) if args.json else render(info))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
