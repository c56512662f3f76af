"""``commlib.ZeroRedundancyOptimizer``: ZeRO stage 1 (optimizer state sharded across ranks).

Each parameter is owned by one rank of the group, chosen greedily (largest first, to the
rank that owns the fewest elements so far, param group by param group: the rule of
``torch.distributed.optim.ZeroRedundancyOptimizer``). Each rank builds ``optimizer_class``
over the parameters it owns only, so it holds and updates 1/N of the optimizer state; after
its local step the updated parameters travel to every rank in one ``allgather`` per dtype
and device (counted in ``commlib.stats()``). Gradients must already be averaged when
``step()`` runs (by :class:`commlib.DistributedDataParallel`, or by the caller).
"""
from __future__ import annotations

import io
from typing import Any, Callable, Iterable

import numpy as np
import torch

from .. import runtime
from ..primitives import allgather, gather, new_group
from .groups import resolve_group


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer_class`` so that each rank of ``group`` keeps the state of its shard.

    ``params``: tensors or param-group dicts, as for any ``torch.optim`` optimizer; every rank
    of ``group`` passes the same parameters (same order, shapes, dtypes). ``group``: a
    ``commlib.Group`` or a torch ``ProcessGroup`` (``process_group=`` is the torch name);
    ``None`` is the world. Collective over ``group`` at construction (a private communicator
    is made) and in :meth:`step` and :meth:`consolidate_state_dict`.

    ``param_groups`` are the global groups (all parameters); schedulers and the user change
    their hyper-parameters, which are handed to the local optimizer at each step. After
    ``step()``, every parameter holds its owner's updated value on every rank (bitwise).
    ``param_groups`` hold ``optimizer_class``'s defaults (``betas``, ``eps``...) from
    construction on, and a group added by :meth:`add_param_group` gets them too (torch's
    ZeroRedundancyOptimizer syncs them the same way), so a consolidated state dict loads
    into a plain ``optimizer_class``.
    ``parameters_as_bucket_view`` and ``overlap_with_ddp`` (torch's arguments) must be False.

    The private communicator is released by :meth:`close` (idempotent; the optimizer is
    also a context manager that closes on exit) or, failing that, when the optimizer is
    garbage-collected. MPI has about 2000 communicators: call ``close()`` when an optimizer
    is replaced (e.g. one per trial of a hyper-parameter search) rather than relying on
    the garbage collector's timing.
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type, group: Any = None,
                 process_group: Any = None, parameters_as_bucket_view: bool = False,
                 overlap_with_ddp: bool = False, **defaults: Any) -> None:
        rank = runtime.get_rank()
        if not (isinstance(optimizer_class, type)
                and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"ZeroRedundancyOptimizer (rank {rank}): argument "
                            f"'optimizer_class' must be a torch.optim.Optimizer subclass, got "
                            f"{optimizer_class!r}")
        if parameters_as_bucket_view or overlap_with_ddp:
            raise ValueError(f"ZeroRedundancyOptimizer (rank {rank}): "
                             f"parameters_as_bucket_view and overlap_with_ddp are not "
                             f"supported (pass False)")
        if group is not None and process_group is not None:
            raise ValueError(f"ZeroRedundancyOptimizer (rank {rank}): pass 'group' or "
                             f"'process_group', not both")
        self._initialized = False
        self._closed = True   # until the communicator exists
        self._optimizer_class = optimizer_class
        self._defaults = dict(defaults)
        super().__init__(params, defaults)
        parent = resolve_group(group if group is not None else process_group,
                               "ZeroRedundancyOptimizer")
        self.process_group = new_group(parent=parent)
        self._closed = False
        try:
            self.rank = self.process_group.rank
            self.world_size = self.process_group.size
            self._all_state_dicts: list[dict] = []
            self._partition()
            params_here = [{**_hyper(g), "params": mine}
                           for g, mine in zip(self.param_groups, self._mine)]
            self.optim = optimizer_class(params_here, **defaults)
        except BaseException:
            self.close()
            raise
        self._fill_defaults(range(len(self.param_groups)))
        self._initialized = True

    def _fill_defaults(self, indices: Iterable[int]) -> None:
        """Give the global groups ``indices`` the local optimizer's options they lack (its
        defaults; every rank's local optimizer has every group, possibly empty)."""
        for i in indices:
            for key, value in self.optim.param_groups[i].items():
                if key != "params":
                    self.param_groups[i].setdefault(key, value)

    def close(self) -> None:
        """Release the private communicator (idempotent; not collective). The optimizer
        cannot step, consolidate or load afterwards."""
        if not getattr(self, "_closed", True):
            self._closed = True
            self.process_group.free()

    def __enter__(self) -> "ZeroRedundancyOptimizer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 (MPI may already be finalized at exit)
            pass

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"ZeroRedundancyOptimizer.{what} (rank {self.rank}): the "
                               f"optimizer was closed")

    # -- partition ----------------------------------------------------------------------
    def _partition(self) -> None:
        """``self._owner``: id(param) -> rank; ``self._mine``: this rank's params per group;
        ``self._order``: every param in global-index order."""
        sizes = [0] * self.world_size
        self._owner: dict[int, int] = {}
        self._mine: list[list[torch.Tensor]] = []
        self._order = [p for g in self.param_groups for p in g["params"]]
        for g in self.param_groups:
            mine = []
            for p in sorted(g["params"], key=lambda t: t.numel(), reverse=True):
                r = int(np.argmin(sizes))
                sizes[r] += p.numel()
                self._owner[id(p)] = r
            mine = [p for p in g["params"] if self._owner[id(p)] == self.rank]
            self._mine.append(mine)
        self._shard_numel = sizes

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (on every rank, the same); its parameters are assigned to
        ranks by the same greedy rule; earlier assignments are unchanged."""
        super().add_param_group(param_group)
        if not self._initialized:
            return
        self._partition()
        self.optim.add_param_group({**_hyper(self.param_groups[-1]),
                                    "params": self._mine[-1]})
        self._fill_defaults([len(self.param_groups) - 1])

    # -- step ---------------------------------------------------------------------------
    def _sync_to_local(self) -> None:
        for g, local in zip(self.param_groups, self.optim.param_groups):
            for key, value in g.items():
                if key != "params":
                    local[key] = value

    def _sync_from_local(self) -> None:
        for g, local in zip(self.param_groups, self.optim.param_groups):
            for key, value in local.items():
                if key != "params":
                    g[key] = value

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Step the local optimizer over this rank's shard (gradients must already be the
        averaged ones), then all-gather the updated parameters: on return every rank holds
        every parameter's new value. Collective over the group. Returns the closure's loss."""
        self._check_open("step")
        self._sync_to_local()
        loss = self.optim.step(closure) if closure is not None else self.optim.step()
        self._sync_from_local()
        self._gather_parameters()
        return loss

    @torch.no_grad()
    def _gather_parameters(self) -> None:
        """One ``allgather`` per dtype and device of each rank's owned parameters, padded
        to the largest rank's count (``allgather_v`` is avoided: MPICH 5.0's
        ``MPI_Allgatherv`` took 158 ms where ``MPI_Allgather`` took 3.6 ms for 1.8 MB per
        rank at 2 ranks, raw mpi4py, on the development machine)."""
        if self.world_size == 1:
            return
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for p in self._order:
            by_kind.setdefault((str(p.dtype), str(p.device)), []).append(p)
        for key in sorted(by_kind):
            params = by_kind[key]
            counts = [0] * self.world_size
            for p in params:
                counts[self._owner[id(p)]] += p.numel()
            width = max(counts)
            template = params[0]
            send = torch.zeros(width, dtype=template.dtype, device=template.device)
            offset = 0
            for p in params:
                if self._owner[id(p)] == self.rank:
                    send[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
                    offset += p.numel()
            rows = allgather(send, self.process_group)
            offsets = [0] * self.world_size
            for p in params:
                r = self._owner[id(p)]
                n = p.numel()
                if r != self.rank:
                    p.copy_(rows[r, offsets[r]:offsets[r] + n].view_as(p))
                offsets[r] += n

    # -- state ---------------------------------------------------------------------------
    def _global_index(self) -> dict[int, int]:
        return {id(p): i for i, p in enumerate(self._order)}

    def _local_to_global(self, rank: int) -> list[int]:
        """Global indices of ``rank``'s parameters in its local optimizer's order."""
        index = self._global_index()
        return [index[id(p)] for g in self.param_groups for p in g["params"]
                if self._owner[id(p)] == rank]

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect every rank's optimizer state on rank ``to`` (a rank of the group), whose
        :meth:`state_dict` then returns the full state. Collective over the group."""
        self._check_open("consolidate_state_dict")
        if not 0 <= to < self.world_size:
            raise ValueError(f"ZeroRedundancyOptimizer.consolidate_state_dict (rank "
                             f"{self.rank}): argument 'to' must be a rank of the group "
                             f"(0..{self.world_size - 1}), got {to}")
        stream = io.BytesIO()
        torch.save(self.optim.state_dict(), stream)
        mine = np.frombuffer(stream.getvalue(), dtype=np.uint8)
        lengths = allgather(np.array([mine.size], dtype=np.int64), self.process_group)
        padded = np.zeros(int(lengths.max()), dtype=np.uint8)
        padded[:mine.size] = mine
        rows = gather(padded, to, self.process_group)
        self._all_state_dicts = []
        if self.rank == to:
            self._all_state_dicts = [
                torch.load(io.BytesIO(rows[r][:int(lengths[r, 0])].tobytes()),
                           weights_only=False) for r in range(self.world_size)]

    def state_dict(self) -> dict:
        """The full optimizer state (torch's format, indices over all parameters in
        param-group order), on the rank that :meth:`consolidate_state_dict` targeted;
        ``RuntimeError`` elsewhere or before consolidation."""
        if not self._all_state_dicts:
            raise RuntimeError(
                f"ZeroRedundancyOptimizer (rank {self.rank}): optimizer state has not been "
                f"consolidated on this rank. Call consolidate_state_dict(to=...) on all ranks "
                f"first; state_dict() then works on rank 'to'.")
        state: dict[int, Any] = {}
        for r, local in enumerate(self._all_state_dicts):
            ids = self._local_to_global(r)
            for k, v in local["state"].items():
                state[ids[int(k)]] = v
        index = self._global_index()
        groups = [{**_hyper(g), "params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state (from :meth:`state_dict`, at any world size): every rank passes
        the same dict and keeps the state of the parameters it owns."""
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
        ids = self._local_to_global(self.rank)
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        local_state = {i: saved_state[gi] for i, gi in enumerate(ids) if gi in saved_state}
        local_groups, i = [], 0
        for g, mine in zip(self.param_groups, self._mine):
            local_groups.append({**_hyper(g), "params": list(range(i, i + len(mine)))})
            i += len(mine)
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        self._sync_from_local()

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state tensors this rank holds (its shard)."""
        return sum(v.numel() * v.element_size() for s in self.optim.state.values()
                   for v in s.values() if isinstance(v, torch.Tensor))

    def __repr__(self) -> str:
        return (f"ZeroRedundancyOptimizer({self._optimizer_class.__name__}, rank {self.rank} "
                f"of {self.world_size}, owns {self._shard_numel[self.rank]} elements)")


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}
