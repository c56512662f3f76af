"""The group a sharded front-end runs on: a ``commlib.Group``, a torch ``ProcessGroup``
(its ranks) or ``None`` (the world)."""
from __future__ import annotations

from typing import Any

from ..core import runtime


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
# None = as the communicator chose (option wait_poll_us, for the whole job: auto polls
# every 50 us when some host runs more ranks than cores); a number forces it (0: block).
WAIT_POLL_S: float | None = None


def wait_poll_s() -> float | None:
    """How a sharded wrapper's communication threads wait for a collective: ``None`` (the
    default) as the communicator chose (option ``wait_poll_us``: on a host whose ranks
    outnumber its cores, 50 us between tests instead of a blocking MPI wait, which spins and
    takes the core from a rank's compute; at 4 ranks on 2 cores FULL_SHARD's step halved,
    docs/benchmarks/sharded.md, bench_zero.py --wait); ``WAIT_POLL_S`` overrides it for these
    threads (0: block in MPI). It changes only how a rank waits, not what it sends."""
    return None if WAIT_POLL_S is None else float(WAIT_POLL_S)
