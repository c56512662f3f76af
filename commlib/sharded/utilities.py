"""What a user asks of a :class:`~commlib.sharded.FullyShardedDataParallel` besides its
forward and backward, as a mixin of the wrapper: global-norm gradient clipping over the
shards, the param groups over the shards, the memory it holds, and the full optimizer
state dicts (:mod:`commlib.sharded.state` does the cutting and joining); plus the
collectives behind them (gathering a whole chunk, broadcasting the initial values)."""
from __future__ import annotations

from typing import Any

import torch

from ..base.reduce_ops import ReduceOp
from ..primitives import allgather, allreduce, broadcast
from . import state as _state
from .chunks import Chunk
from .config import ShardingStrategy


class WrapperUtilities:
    """Clipping, param groups, memory and optimizer state dicts (mixin of the wrapper)."""

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the shards' gradients (nested wrappers' too) so that the global gradient
        norm (over all ranks' shards, i.e. the whole model, each parameter once) is at most
        ``max_norm``. Returns the norm before clipping (float64 tensor, the same on every
        rank)."""
        norm_type = float(norm_type)
        wrappers = self._wrappers()
        grads, sharded = [], False
        for w in wrappers:
            grads += [c.shard.grad for c in w._chunks if c.shard.grad is not None]
            sharded |= w.sharding_strategy is not ShardingStrategy.NO_SHARD
        if norm_type == float("inf"):
            local = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
            total = torch.tensor([local], dtype=torch.float64)
            if sharded:
                self._run(allreduce, total, ReduceOp.MAX, self.process_group)
            total = total[0]
        else:
            # NO_SHARD wrappers hold whole gradients: counted once, on the group's rank 0
            local = sum(float(torch.linalg.vector_norm(c.shard.grad.double(), norm_type)
                              ** norm_type)
                        for w in wrappers for c in w._chunks if c.shard.grad is not None
                        and (not sharded or c.shards > 1 or self.rank == 0))
            total = torch.tensor([local], dtype=torch.float64)
            if sharded:
                self._run(allreduce, total, ReduceOp.SUM, self.process_group)
            total = total[0] ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    def sharded_param_groups(self) -> list[dict]:
        """The constructor's ``param_groups`` over this rank's shards (with their
        options), plus one group without options for the shards of parameters no entry
        named (nested wrappers' shards included); pass it to a ``torch.optim`` optimizer."""
        others = [c.shard for w in self._wrappers()[1:] for c in w._chunks]
        return _state.sharded_param_groups(self._chunks, self._group_options, others)

    def memory_bytes(self, reset_peak: bool = False) -> dict[str, int]:
        """Bytes this rank holds now for this wrapper's chunks (nested wrappers report
        their own): ``params`` (shards plus gathered chunks, the shard counted once where
        it is a slice of a gathered chunk), ``grads`` (shard gradients plus full gradients
        still held) and ``peak_gathered`` (the most bytes of gathered FULL_SHARD chunks
        held at once since construction or the last ``reset_peak=True``; a gather's
        receive buffer, one chunk per request under way, comes on top)."""
        params = 0
        for c in self._chunks:
            full = c.state_bytes()["full"]
            aliased = c.shards > 1 and c.shard.data_ptr() == c.full.data_ptr() + (
                c.rank * c.shard_numel * c.full.element_size()) and full
            params += full + (0 if aliased else c.shard.numel() * c.shard.element_size())
        grads = sum(c.shard.grad.numel() * c.shard.grad.element_size()
                    for c in self._chunks if c.shard.grad is not None)
        grads += sum(c.full.grad.numel() * c.full.grad.element_size()
                     for c in self._chunks if c.full.grad is not None)
        secondary = sum(t.numel() * t.element_size() for t, _ in self._secondary.values())
        out = {"params": params, "grads": grads, "peak_gathered": self._gathered_bytes[1],
               "secondary": secondary}
        if reset_peak:
            self._gathered_bytes[1] = self._gathered_bytes[0]
        return out

    # -- optimizer state dicts ----------------------------------------------------------
    # (the module's own state dict: torch's state_dict()/load_state_dict() through the
    # hooks of state.FullStateHooks: the unwrapped module's keys, full values)

    @staticmethod
    def optim_state_dict(model: Any,
                         optim: torch.optim.Optimizer) -> dict:
        """The optimizer's full state keyed by parameter name (the unwrapped module's names;
        element-wise state gathered from the shards, nested wrappers' included), on every
        rank; loads at any world size through :meth:`optim_state_dict_to_load`. Collective
        over the group."""
        return _state.full_optim_state_dict(model._named_chunks(), full_chunk, model.rank,
                                            optim)

    @staticmethod
    def optim_state_dict_to_load(model: Any,
                                 optim: torch.optim.Optimizer, optim_state_dict: dict) -> dict:
        """This rank's optimizer state dict (for ``optim.load_state_dict``) cut from a full
        one made by :meth:`optim_state_dict`."""
        return _state.shard_optim_state_dict(model._named_chunks(), model.rank, optim,
                                             optim_state_dict)


@torch.no_grad()
def broadcast_coalesced(tensors: list[torch.Tensor], group: Any) -> None:
    """Rank 0's values of ``tensors`` on every rank: one broadcast per dtype and device
    (in first-appearance order, the same on every rank of one model)."""
    kinds: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        kinds.setdefault((t.dtype, t.device), []).append(t)
    for ts in kinds.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        broadcast(flat, 0, group)
        offset = 0
        for t in ts:
            t.detach().copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def full_chunk(c: Chunk, t: torch.Tensor) -> torch.Tensor:
    """The whole flat chunk of a shard-shaped tensor ``t`` of any wrapper's chunk ``c``
    (collective over that wrapper's group when sharded)."""
    if c.shards == 1:
        return t.detach()
    return c.owner()._run(allgather, t.detach().contiguous(),
                          c.owner().process_group).reshape(-1)
