"""When a :class:`~commlib.sharded.FullyShardedDataParallel`'s chunks are gathered and
released, forward and backward (the schedule described in :mod:`commlib.sharded.fsdp`),
as a mixin of the wrapper: the forward pre- and post-hooks, the released-parameter
placeholders' callback, the saved-tensor hooks that gather a chunk again in backward, the
post-accumulate-grad hook that starts each chunk's gradient exchange, and the end of
backward. The attributes it works on are made by the wrapper's constructor."""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..base.reduce_ops import ReduceOp
from ..primitives import allgather, allreduce, reduce_scatter
from .chunks import Chunk
from .quantized import hierarchical_reduce_scatter, quantized_reduce_scatter, start_allgather

# id(chunk.full) -> chunk, for every live wrapper: a saved-tensor hook of any wrapper
# (nested forwards) recognizes any wrapper's parameters
FULLS: weakref.WeakValueDictionary[int, Chunk] = weakref.WeakValueDictionary()


class ChunkSchedule:
    """Gathering and releasing chunks in forward and backward (mixin of the wrapper)."""

    # -- chunk states -------------------------------------------------------------------
    def _free(self, c: Chunk) -> None:
        """FULL_SHARD: release chunk ``c``'s memory; its owners get placeholders (also on
        one rank, where the memory is the shard's and stays: the same uses work and fail
        at every world size)."""
        if c.shards > 1 and c.gathered:
            c.set_released_views()
            c.free()
            self._fresh.discard(c.index)
        elif c.shards == 1 and not c.placeholders:
            c.set_released_views()
            self._fresh.discard(c.index)

    def _restore(self, c: Chunk) -> None:
        """Put views (or, when released, placeholders) back on ``c``'s owners."""
        if c.placeholders or (c.shards > 1 and not c.gathered):
            c.set_released_views()
        else:
            c.set_views()
        self._fresh.discard(c.index)

    def use_released(self, c: Chunk, i: int) -> torch.Tensor:
        """A placeholder of chunk ``c`` was used (see :class:`chunks.ReleasedView`): inside
        this wrapper's forward, gather ``c`` (FULL_SHARD: and keep it for the rest of every
        forward; SHARD_GRAD_OP: wait for its gather under way); anywhere else raise naming
        the parameter. Returns the gathered view of slot ``i``."""
        name = c.slots[i].name
        if self._closed or not self._in_forward:
            why = "the wrapper was closed" if self._closed else (
                "FULL_SHARD holds it gathered only during the forward of the "
                "FullyShardedDataParallel that shards it, and this use is outside that "
                "forward (torch's fully_shard raises here too)")
            raise RuntimeError(f"FullyShardedDataParallel (rank {self.rank}): parameter "
                               f"{name!r} is released: {why}. Wrap a module whose forward "
                               f"holds every use of it, or use SHARD_GRAD_OP; state_dict() "
                               f"gives the full values")
        self._gather(c)
        c.set_views()
        self._fresh.add(c.index)
        self._pinned.add(c.index)
        if self._last_use is not None:
            self._last_use.pop(c.index, None)
        return c.views[i]

    # -- forward ------------------------------------------------------------------------
    def _forward_chunks(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward, with the chunks it uses gathered."""
        if self._backward_started:   # the last backward raised: drop what it exchanged
            pending, self._pending = self._pending, []
            self._backward_started = False
            for _, future in pending:
                future.exception()
        self._end_queued = False
        self._seq = 0
        self._active = {}
        self._recording: dict[int, int] = {}
        self._fresh = set()
        self._saved = set()
        self._releasable = []
        if self._param_dtype is not None:
            args, kwargs = cast((args, kwargs), self._param_dtype)
        self._in_forward = True
        if not self._full_shard:
            # SHARD_GRAD_OP: every chunk whose shard changed is re-gathered, all requests
            # at once; each module waits for its own chunks in its pre-hook. Until then
            # the owners hold placeholders: a use elsewhere (a hook of a parent module)
            # waits for the chunk instead of reading memory MPI is still writing.
            self._agree_stale()
            for i in self._order or range(len(self._chunks)):
                c = self._chunks[i]
                if c.shards == 1 and c.stale():
                    self._gather(c)   # NO_SHARD: mixed precision's cast copy, at once
                self._request(c)
            for c in self._chunks:
                if c.index in self._inflight:
                    c.set_released_views()
                else:
                    c.set_views()
                    self._fresh.add(c.index)
            try:
                return self.module(*args, **kwargs)
            finally:
                self._in_forward = False
                for c in self._chunks:
                    if c.stale():
                        self._gather(c)
                    if c.index not in self._fresh:
                        c.set_views()
                if self._order is None:
                    self._order = self._order_rec
        try:
            if self._order is not None and self._order:
                self._request(self._chunks[self._order[0]])
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return self.module(*args, **kwargs)
        finally:
            self._in_forward = False
            for c in self._chunks:
                self._free(c)
            if self._last_use is None:
                self._last_use = {i: s for i, s in self._recording.items()
                                  if i not in self._pinned}
                self._order = self._order_rec

    def _agree_stale(self) -> None:
        """SHARD_GRAD_OP: a chunk whose shard changed on any rank is stale on every rank
        (one ``allreduce`` of a flag a chunk): the ranks gather the same chunks even when
        one rank's optimizer step failed or was skipped (its shard unchanged)."""
        kept = [c for c in self._chunks if c.shards > 1]
        if not kept:
            return
        flags = torch.tensor([int(c.stale()) for c in kept], dtype=torch.int32)
        self._run(allreduce, flags, ReduceOp.MAX, self.process_group)
        for c, flag in zip(kept, flags.tolist()):
            if flag:
                c.gathered = False   # (kept memory: only marked for a new gather)

    def _request(self, c: Chunk) -> None:
        """Start gathering chunk ``c`` (if it is stale and not already under way). A kept
        chunk (SHARD_GRAD_OP) is received in place (its shard, a slice of it, is sent from
        a copy); a FULL_SHARD chunk into a pooled receive buffer, copied in by
        :meth:`_gather` (memory that MPI wrote through numpy cannot be released)."""
        if c.shards == 1 or c.index in self._inflight or not c.stale():
            return
        if c.keep_full:
            send, out = c.shard.detach().clone(), c.full.detach()
        else:
            send = c.shard.detach().to(c.compute_dtype)
            pool = self._recv_pool.setdefault((c.compute_dtype, c.device, c.padded), [])
            out = pool.pop() if pool else torch.empty(c.padded, dtype=c.compute_dtype,
                                                      device=c.device)
        secondary = self._secondary.get(c.index)
        if secondary is not None and secondary[1] == c.shard._version and \
                not self._in_forward:
            # hpZ: this node's copy of the chunk (what the forward's gather decoded), from
            # the node's ranks only; in backward only, where every rank's copy is of this
            # step's forward (a forward's own test, "my shard is unchanged", is this rank's
            # alone: one whose step failed or was skipped would gather over the node while
            # the others gather over the group)
            future = self._gather_engine.submit(allgather, secondary[0], self._node_group,
                                                True, out)
        elif self._weight_block and c.shard.is_floating_point() and not c.keep_full:
            # qwZ: the master shard quantized (full precision in, one byte an element out)
            future = start_allgather(self._gather_engine, c.shard.detach(),
                                     self.process_group, self._weight_block, out)
        else:
            future = self._gather_engine.submit(allgather, send, self.process_group, True,
                                                out)
        self._inflight[c.index] = (future, c.shard._version)

    def _gather(self, c: Chunk) -> None:
        """Make chunk ``c`` gathered now (waiting for its request, or making one)."""
        if c.shards > 1:
            item = self._inflight.pop(c.index, None)
            if item is not None and item[1] != c.shard._version:
                received = item[0].result().result()   # gathered before the shard changed
                if not c.keep_full:
                    self._recv_pool[(c.compute_dtype, c.device, c.padded)].append(received)
                item = None
            if item is None:
                self._request(c)
                item = self._inflight.pop(c.index)
            received = item[0].result().result()
            if not c.keep_full:
                c.fill(received)
                if self._node_group is not None and self._in_forward:
                    # hpZ: keep this rank's slice of the node's copy for backward
                    m, local = self._node_group.size, self._node_group.rank
                    part = c.padded // m
                    self._secondary[c.index] = (
                        received[local * part:(local + 1) * part].clone(), c.shard._version)
                self._recv_pool[(c.compute_dtype, c.device, c.padded)].append(received)
        elif c.cast:
            c.fill(c.shard.detach())
        c.mark_gathered()
        if self._order is None and c.index not in self._order_rec:
            self._order_rec.append(c.index)

    def _prefetch_after(self, c: Chunk, step: int) -> None:
        """Request the next ``self.prefetch`` chunks after ``c`` in first-use order
        (``step=-1``: before it, for backward, only chunks autograd saved views of)."""
        if self._order is None or c.index not in self._order:
            return
        pos = self._order.index(c.index)
        seq = self._order[pos + 1:] if step > 0 else self._order[:pos][::-1]
        if step < 0:
            seq = [i for i in seq if i in self._saved]
        for i in seq[:self.prefetch]:
            self._request(self._chunks[i])

    def _flush_releases(self, keep: Any = ()) -> None:
        """Release the chunks whose last module has finished (its forward hooks included),
        except ``keep`` (the chunks of the module about to run)."""
        pending, self._releasable = self._releasable, []
        for c in pending:
            if c not in keep and not self._active.get(c.index):
                self._free(c)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        owned = self._owned.get(id(module), ())
        if self._full_shard:
            self._flush_releases(owned)
        for c in owned:
            self._active[c.index] = self._active.get(c.index, 0) + 1
            if c.stale():
                self._gather(c)
                if self._full_shard:
                    self._prefetch_after(c, 1)
            if c.index not in self._fresh:
                c.set_views()   # under this forward's grad mode, on gathered memory
                self._fresh.add(c.index)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._full_shard:
            return
        self._flush_releases()
        self._seq += 1
        first = self._last_use is None
        for c in self._owned.get(id(module), ()):
            self._active[c.index] -= 1
            if first:
                self._recording[c.index] = self._seq
            elif self._last_use.get(c.index) == self._seq and not self._active[c.index]:
                self._releasable.append(c)   # after the user's forward hooks of module

    def _queue_end(self) -> None:
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    # -- backward -----------------------------------------------------------------------
    def _on_grad(self, full: torch.Tensor) -> None:
        c = self._by_full[id(full)]
        self._backward_started = True
        self._queue_end()
        if self._full_shard:
            self._free(c)
        if not self._sync:
            return  # no_sync: the full gradient keeps accumulating
        grad = full.grad
        full.grad = None
        self._pending.append((c, self._engine.submit(self._exchange, c, grad)))

    def _exchange(self, c: Chunk, grad: torch.Tensor) -> Any:
        if self._reduce_dtype is not None:
            grad = grad.to(self._reduce_dtype)
        if c.shards == 1:
            return allreduce(grad, ReduceOp.AVG, self._reduce_group, async_op=True)
        if self._grad_block and grad.is_floating_point():
            # qgZ: quantized parts through one alltoall, decoded and summed in float64
            # (hierarchical: reduced inside the node first, in full precision)
            if self._hierarchy is not None:
                return hierarchical_reduce_scatter(grad.reshape(-1), self._hierarchy,
                                                   self._grad_block,
                                                   bits=self.gradient_quantization)
            return quantized_reduce_scatter(grad.reshape(-1), self._reduce_group,
                                            self._grad_block, bits=self.gradient_quantization)
        return reduce_scatter(grad, ReduceOp.AVG, self._reduce_group, async_op=True)

    def _end_backward(self) -> None:
        pending, self._pending = self._pending, []
        self._backward_started = False
        self._end_queued = False
        for c, future in pending:
            grad = future.result()
            grad = grad.result() if hasattr(grad, "result") else grad   # a Work, or a tensor
            shard = c.shard
            grad = grad.to(shard.dtype)
            if shard.grad is None:
                shard.grad = grad.view_as(shard)
            else:
                shard.grad.add_(grad.view_as(shard))
        if self._full_shard:
            for c in self._chunks:
                self._free(c)


def pack(t: torch.Tensor) -> Any:
    base = t._base if t._base is not None else t
    chunk = FULLS.get(id(base))
    if chunk is not None and chunk.full is base:
        chunk.owner()._saved.add(chunk.index)
        return chunk, t
    return None, t


def unpack(packed: Any) -> torch.Tensor:
    chunk, t = packed
    if chunk is not None and not chunk.gathered:
        owner = chunk.owner()
        owner._gather(chunk)
        owner._prefetch_after(chunk, -1)
        owner._queue_end()   # released again at the end of this backward
    return t


def cast(obj: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors inside ``obj`` (tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(cast(o, dtype) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast(v, dtype) for k, v in obj.items()}
    return obj
