"""The group a sharded front-end runs on: a ``commlib.Group``, a torch ``ProcessGroup``
(its ranks) or ``None`` (the world)."""
from __future__ import annotations

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
