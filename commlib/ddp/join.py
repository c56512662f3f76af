"""Uneven inputs: ``DistributedDataParallel.join()``, with torch DDP's ``join()`` semantics.

While any rank still has data, each training forward of a rank that has data starts with
one small allreduce of ``[1, syncing]``; a rank that left the ``with`` block (out of data)
contributes ``[0, 0]`` in a loop and, while the count of ranks with data is positive,
*shadows* their iteration: the same collectives with zero gradients (see
``DistributedDataParallel._shadow_iteration``), so no collective is left unmatched. When the
count reaches zero every rank leaves, and the parameters and buffers of the last rank to
run out of data (the one with the most iterations, ties to the highest rank) are broadcast
to all, as torch does.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..primitives import allreduce
from ..reduce_ops import ReduceOp


class Join:
    """Returned by :meth:`DistributedDataParallel.join`; use as a context manager."""

    def __init__(self, ddp: Any, divide_by_initial_world_size: bool, enable: bool,
                 throw_on_early_termination: bool) -> None:
        self.ddp = ddp
        self.divide_by_initial_world_size = bool(divide_by_initial_world_size)
        self.enable = bool(enable)
        self.throw_on_early_termination = bool(throw_on_early_termination)
        self.iterations = 0

    def __enter__(self) -> "Join":
        if self.enable:
            if self.ddp._join is not None:
                raise RuntimeError("DistributedDataParallel.join(): already inside a join() "
                                   "context of this model")
            self.ddp._join = self
        return self

    def _count(self, mine: list[int]) -> np.ndarray:
        counts = np.array(mine, dtype=np.int64)
        self.ddp._engine.submit(allreduce, counts, ReduceOp.SUM, self.ddp.process_group).result()
        return counts

    def _early_termination(self) -> RuntimeError:
        return RuntimeError(f"commlib.DistributedDataParallel (rank "
                            f"{self.ddp.process_group.rank}): detected at least one rank that "
                            f"exhausted inputs. Throwing across all ranks.")

    def notify(self, ddp: Any) -> None:
        """Called at each training forward of a rank that has data."""
        active, _ = self._count([1, int(ddp._sync)])
        self.iterations += 1
        size = ddp.process_group.size
        if self.throw_on_early_termination and active < size:
            raise self._early_termination()
        ddp._hooks.grad_scale = (1.0 if self.divide_by_initial_world_size
                                 else size / float(active))

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enable:
            return
        ddp = self.ddp
        try:
            if exc_type is not None:
                return
            while True:
                active, syncing = self._count([0, 0])
                if active == 0:
                    break
                if self.throw_on_early_termination:
                    raise self._early_termination()
                ddp._hooks.grad_scale = (1.0 if self.divide_by_initial_world_size
                                         else ddp.process_group.size / float(active))
                ddp._shadow_iteration(sync=syncing > 0)
            self._sync_final_model()
        finally:
            ddp._join = None
            ddp._hooks.grad_scale = 1.0

    def _sync_final_model(self) -> None:
        ddp = self.ddp
        size = ddp.process_group.size
        key = np.array([self.iterations * size + ddp.process_group.rank], dtype=np.int64)
        ddp._engine.submit(allreduce, key, ReduceOp.MAX, ddp.process_group).result()
        last = int(key[0] % size)
        ddp._broadcast([p for _, p in ddp._ctx.named_parameters] + ddp._buffers_to_sync(),
                       src=last)
