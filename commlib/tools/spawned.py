"""``python -m commlib.tools.spawned SCRIPT ARGS...``: the entry point of a process that
:mod:`commlib.elastic` spawns into a running fault-tolerant job (a refill's warm spare).

It starts MPI and joins its parents' world first (``commlib.init(fault_tolerant=True)``,
which imports neither torch nor the script's own modules): the parents' spawn, which waits
for that, returns a fraction of a second after the process started instead of after the
script's imports. Then it runs ``SCRIPT`` as ``python SCRIPT ARGS...`` would
(``__name__ == "__main__"``, ``sys.argv``, ``sys.path[0]`` the script's folder); the
script's own ``commlib.init()`` finds commlib initialized (options it passes still apply).
"""
from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m commlib.tools.spawned SCRIPT [ARGS...]")
    # (known before MPI starts: commlib prepares UCX for fault-tolerant mode at import)
    os.environ["COMMLIB_FAULT_TOLERANT"] = "1"
    import commlib
    commlib.init(fault_tolerant=True)
    script = os.path.abspath(argv[0])
    sys.argv = argv
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
