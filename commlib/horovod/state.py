"""The Horovod front-end's process-wide state between ``init()`` and ``shutdown()``."""
from __future__ import annotations

import weakref
from typing import Any


class State:
    """What ``hvd.init()`` set up: the Horovod world (a commlib group), this process's
    place in it and on its node, the registered process sets and their controllers."""

    def __init__(self, group: Any, local_rank: int, local_size: int, cross_rank: int,
                 cross_size: int, homogeneous: bool) -> None:
        self.group = group            # commlib Group of the Horovod world
        self.rank = group.rank
        self.size = group.size
        self.local_rank, self.local_size = local_rank, local_size
        self.cross_rank, self.cross_size = cross_rank, cross_size
        self.homogeneous = homogeneous
        self.process_sets: dict[int, Any] = {}
        self.controllers: dict[int, Any] = {}
        self.next_set_id = 1


current: State | None = None


def require(what: str) -> State:
    """The state, or Horovod's ``ValueError`` when ``init()`` was not called."""
    if current is None:
        raise ValueError(f"Horovod has not been initialized; use hvd.init() (before "
                         f"commlib.horovod.{what}).")
    return current


#: Every DistributedOptimizer made (rebuilt over the survivors by hvd.elastic.run).
optimizers: weakref.WeakSet = weakref.WeakSet()


def rebuild_optimizers() -> None:
    """After an elastic reset: every live DistributedOptimizer rebuilds its exchange over
    the new Horovod world."""
    for opt in list(optimizers):
        opt._hvd_rebuild()
