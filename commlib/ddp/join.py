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
from torch.distributed.algorithms.join import JoinHook

from ..base.reduce_ops import ReduceOp
from ..primitives import allreduce


class Join:
    """Returned by :meth:`DistributedDataParallel.join`; use as a context manager."""

    def __init__(self, ddp: Any, divide_by_initial_world_size: bool, enable: bool,
                 throw_on_early_termination: bool) -> None:
        self.ddp = ddp
        self.divide_by_initial_world_size = bool(divide_by_initial_world_size)
        self.enable = bool(enable)
        self.throw_on_early_termination = bool(throw_on_early_termination)
        self.iterations = 0

    def __enter__(self) -> Join:
        if self.enable:
            if self.ddp._join is not None:
                raise RuntimeError("DistributedDataParallel.join(): already inside a join() "
                                   "context of this model")
            self.ddp._join = self
        return self

    def _count(self, mine: list[int]) -> np.ndarray:
        return _count(self.ddp, mine)

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


class TorchJoinHook(JoinHook):
    """What torch's generic ``torch.distributed.algorithms.join.Join`` calls on a rank that
    ran out of data (``ddp.join_hook()``): ``main_hook`` shadows one iteration of the
    others, ``post_hook`` syncs the final model from the last rank to join. Used when the
    wrapper sits in torch's ``Join([ddp, other_joinables...])`` (which needs
    ``torch.distributed`` initialized, e.g. with the ``commlib`` backend)."""

    def __init__(self, ddp: Any, divide_by_initial_world_size: bool = True) -> None:
        self.ddp = ddp
        self.divide_by_initial_world_size = bool(divide_by_initial_world_size)

    def main_hook(self) -> None:
        ddp = self.ddp
        active, syncing = _count(ddp, [0, 0])
        ddp._hooks.grad_scale = (1.0 if self.divide_by_initial_world_size or not active
                                 else ddp.process_group.size / float(active))
        ddp._shadow_iteration(sync=syncing > 0)

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        ddp._hooks.grad_scale = 1.0
        key = np.array([ddp.process_group.rank if is_last_joiner else -1], dtype=np.int64)
        ddp._engine.submit(allreduce, key, ReduceOp.MAX, ddp.process_group).result()
        ddp._broadcast([p for _, p in ddp._ctx.named_parameters] + ddp._buffers_to_sync(),
                       src=int(key[0]))


def notify_torch_join(ddp: Any) -> None:
    """At a training forward inside torch's ``Join``: torch's own notification (over the
    torch process group), then the active/syncing counts the shadowing ranks read."""
    from torch.distributed.algorithms.join import Join as TorchJoin
    TorchJoin.notify_join_context(ddp)
    if ddp._join_config.enable:
        active, _ = _count(ddp, [1, int(ddp._sync)])
        hook = ddp._torch_join_hook
        if hook is not None and not hook.divide_by_initial_world_size:
            ddp._hooks.grad_scale = ddp.process_group.size / float(active)


def _count(ddp: Any, mine: list[int]) -> np.ndarray:
    counts = np.array(mine, dtype=np.int64)
    ddp._engine.submit(allreduce, counts, ReduceOp.SUM, ddp.process_group).result()
    return counts
