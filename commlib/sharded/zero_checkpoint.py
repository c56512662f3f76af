"""The state-dict protocol of :class:`commlib.ZeroRedundancyOptimizer` (a mixin: torch's
names and format): ``consolidate_state_dict(to)`` collects every rank's shard state on one
rank, whose ``state_dict()`` is then the full state (indices over all parameters in
param-group order, each element-wise value of its parameter's shape), and
``load_state_dict`` takes a full state saved at any world size (or by a plain optimizer over
the same parameters), each rank keeping what it owns. The conversions between full and
sharded state are :mod:`commlib.sharded.zero_state`'s."""
from __future__ import annotations

import io

import numpy as np
import torch

from ..primitives import allgather, gather
from . import zero_state


class ZeroStateDict:
    """State-dict methods over the optimizer's partition (``self.optim``, ``_kinds``,
    ``_mine``, ``process_group``, ``rank``, ``world_size``, ``_all_state_dicts``)."""

    def _groups(self) -> list[list[torch.Tensor]]:
        return [list(g["params"]) for g in self.param_groups]

    def _every_local_state(self, to: int | None = None) -> list[dict]:
        """Every rank's local optimizer ``state`` (on rank ``to``; ``None``: on every rank;
        elsewhere ``[]``). Collective over the group."""
        stream = io.BytesIO()
        torch.save(self.optim.state_dict()["state"], stream)
        mine = np.frombuffer(stream.getvalue(), dtype=np.uint8)
        lengths = allgather(np.array([mine.size], dtype=np.int64), self.process_group)
        padded = np.zeros(int(lengths.max()), dtype=np.uint8)
        padded[:mine.size] = mine
        if to is None:
            rows = allgather(padded, self.process_group)
        else:
            rows = gather(padded, to, self.process_group)
            if self.rank != to:
                return []
        return [torch.load(io.BytesIO(rows[r][:int(lengths[r, 0])].tobytes()),
                           weights_only=False) for r in range(self.world_size)]

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect every rank's optimizer state on rank ``to`` (a rank of the group), whose
        :meth:`state_dict` then returns the full state. Collective over the group."""
        self._check_open("consolidate_state_dict")
        if not 0 <= to < self.world_size:
            raise ValueError(f"ZeroRedundancyOptimizer.consolidate_state_dict (rank "
                             f"{self.rank}): argument 'to' must be a rank of the group "
                             f"(0..{self.world_size - 1}), got {to}")
        self._drain()
        self._all_state_dicts = self._every_local_state(to)

    def state_dict(self) -> dict:
        """The full optimizer state (torch's format, indices over all parameters in
        param-group order, each element-wise value of its parameter's shape), on the rank
        that :meth:`consolidate_state_dict` targeted; ``RuntimeError`` elsewhere or before
        consolidation."""
        if not self._all_state_dicts:
            raise RuntimeError(
                f"ZeroRedundancyOptimizer (rank {self.rank}): optimizer state has not been "
                f"consolidated on this rank. Call consolidate_state_dict(to=...) on all ranks "
                f"first; state_dict() then works on rank 'to'.")
        state = zero_state.full_state(self._kinds, self._groups(), self._all_state_dicts)
        groups, at = [], 0
        for g in self.param_groups:
            groups.append({**_hyper(g), "params": list(range(at, at + len(g["params"])))})
            at += len(g["params"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state (from :meth:`state_dict` or a plain ``optimizer_class`` over
        the same parameters, saved at any world size): every rank passes the same dict
        and keeps the state of the elements it owns."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"ZeroRedundancyOptimizer.load_state_dict (rank {self.rank}): "
                             f"the state has {len(groups)} param groups, this optimizer "
                             f"{len(self.param_groups)}")
        for g, saved in zip(self.param_groups, groups):
            if len(saved["params"]) != len(g["params"]):
                raise ValueError(f"ZeroRedundancyOptimizer.load_state_dict (rank "
                                 f"{self.rank}): a param group of {len(saved['params'])} "
                                 f"parameters where {len(g['params'])} were expected")
            g.update(_hyper(saved))
        order = [i for saved in groups for i in saved["params"]]
        by_position = {pos: state_dict["state"][i] for pos, i in enumerate(order)
                       if i in state_dict["state"]}
        self._load_local(by_position)
        self._sync_from_local()

    def _load_local(self, full: dict[int, dict]) -> None:
        """This rank's shards' state from a full state keyed by global position."""
        local_state = zero_state.local_state(self._kinds, self._groups(), self.rank, full)
        local_groups, i = [], 0
        for g, mine in zip(self.param_groups, self._mine):
            local_groups.append({**_hyper(g), "params": list(range(i, i + len(mine)))})
            i += len(mine)
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}
