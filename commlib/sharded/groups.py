"""The group a sharded front-end runs on: a ``commlib.Group``, a torch ``ProcessGroup``
(its ranks) or ``None`` (the world)."""
from __future__ import annotations

import os
from typing import Any

from .. import runtime


def resolve_group(group: Any, who: str) -> Any:
    """The commlib group behind ``group`` (``None``: the world); ``TypeError`` naming ``who``
    for anything else."""
    from ..ddp import arguments
    from ..primitives import Group
    if group is None or isinstance(group, Group):
        return group
    try:
        import torch.distributed as dist
        if isinstance(group, dist.ProcessGroup):
            return arguments.resolve_group(group, None)
    except ImportError:
        pass
    raise TypeError(f"{who} (rank {runtime.get_rank()}): argument 'group' must be None, a "
                    f"commlib.Group or a torch.distributed.ProcessGroup, got "
                    f"{type(group).__name__}")


# How the sharded front-ends' communication threads wait for MPI (Engine's poll_s):
# None = decide per wrapper at construction (below); a number forces it (0: block in MPI).
WAIT_POLL_S: float | None = None


def wait_poll_s() -> float | None:
    """How a sharded wrapper's communication threads wait for a collective: 50 us between
    tests when this node's ranks outnumber its cores (a blocking MPI wait spins and takes
    the core from a rank's compute: benchmarks/README.md, bench_zero.py), else ``None``
    (the communicator's choice, option ``wait_poll_us``, decided for the whole job).
    ``WAIT_POLL_S`` overrides it (0: block in MPI). Decided from the node's rank count, the
    same on every rank of a node; it changes only how a rank waits, not what it sends."""
    if WAIT_POLL_S is not None:
        return float(WAIT_POLL_S)
    return 50e-6 if runtime.get_local_size() > (os.cpu_count() or 1) else None
