"""``commlib.FullyShardedDataParallel``: ZeRO stages 2 and 3 over flat parameter chunks.

Strategies (torch FSDP's names):

* ``NO_SHARD``: every rank keeps whole chunks; gradients are allreduced (plain DP).
* ``SHARD_GRAD_OP`` (ZeRO-2): every rank keeps the gathered chunks between steps; after
  backward each chunk's gradient is reduce-scattered (averaged) into this rank's shard and
  the full gradient released; before the next forward, chunks whose shard changed (an
  optimizer step, a load) are all-gathered again.
* ``FULL_SHARD`` (ZeRO-3): a chunk is all-gathered just before the first module that uses
  it runs (forward pre-hooks), released after the last one (learned in the first forward),
  gathered again during backward when autograd needs a saved parameter (saved-tensor
  hooks), and released once its gradient has been reduce-scattered.

Gradient exchanges start as soon as autograd has accumulated a chunk's gradient
(post-accumulate-grad hook) and run on a communication thread (the DDP engine), on a
communicator of their own; gathers run on a second thread on another communicator
(FULL_SHARD prefetches the next chunk in first-use order, forward and backward), each
stream in an order every rank shares. ``backward()`` returns once every shard's ``.grad``
holds its averaged gradient.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from .. import runtime
from ..ddp.engine import Engine
from ..primitives import allgather, allreduce, broadcast, new_group, reduce_scatter
from ..reduce_ops import ReduceOp
from . import state as _state
from .chunks import Chunk, detach_parameters, owned_chunks, plan
from .groups import resolve_group


class ShardingStrategy(str, enum.Enum):
    """What is sharded across the ranks (torch FSDP's names)."""
    FULL_SHARD = "FULL_SHARD"          # parameters, gradients, optimizer state (ZeRO-3)
    SHARD_GRAD_OP = "SHARD_GRAD_OP"    # gradients and optimizer state (ZeRO-2)
    NO_SHARD = "NO_SHARD"              # nothing (data parallelism)


@dataclasses.dataclass
class MixedPrecision:
    """torch FSDP's mixed-precision policy (torch's own ``MixedPrecision`` works too).

    ``param_dtype``: the gathered chunks (what forward and backward compute with) and the
    forward inputs; the shards, which the optimizer updates, stay in the parameters' dtype
    (master weights). ``reduce_dtype``: gradients are reduce-scattered in it (default
    ``param_dtype``), then stored in the shards' dtype. ``buffer_dtype``: floating-point
    buffers are cast to it once, at construction."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None


class FullyShardedDataParallel(nn.Module):
    """Shard ``module``'s parameters in flat chunks across the ranks of ``group``.

    Collective over ``group`` (``None``: the world; a ``commlib.Group`` or a torch
    ``ProcessGroup``; ``process_group=`` is torch's name). At construction rank 0's
    parameters and buffers are broadcast, parameters are packed into chunks of about
    ``chunk_size_mb`` MiB (same dtype, device, ``requires_grad`` and entry of
    ``param_groups``; zero-padded to a multiple of the group size), and each rank keeps its
    1/N slice as an ``nn.Parameter``: :meth:`parameters` yields only these shards (1-D, the
    chunk's dtype), so a ``torch.optim`` optimizer built over them holds 1/N of the state.
    The module's own parameters become plain tensors (views into the gathered chunks).

    ``param_groups``: optional list of dicts ``{"params": [module parameters or names],
    **options}`` for optimizers with several param groups: chunks never mix two entries;
    :meth:`sharded_param_groups` returns the same dicts over the shards. Every rank must
    run the same forward and backward (the same chunks get gradients) each step.
    ``mixed_precision``: a :class:`MixedPrecision` (or torch's): compute in
    ``param_dtype`` (half the bytes gathered), reduce in ``reduce_dtype``, keep the shards
    and the optimizer in the parameters' dtype.
    """

    def __init__(self, module: nn.Module, sharding_strategy: str | ShardingStrategy =
                 ShardingStrategy.FULL_SHARD, group: Any = None, *,
                 process_group: Any = None, chunk_size_mb: float = 4.0,
                 param_groups: list[dict] | None = None, mixed_precision: Any = None,
                 sync_module_states: bool = True) -> None:
        super().__init__()
        rank = runtime.get_rank()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel (rank {rank}): argument 'module' must "
                            f"be a torch.nn.Module, got {type(module).__name__}")
        try:
            self.sharding_strategy = ShardingStrategy(
                getattr(sharding_strategy, "name", sharding_strategy))
        except ValueError:
            raise ValueError(f"FullyShardedDataParallel (rank {rank}): argument "
                             f"'sharding_strategy' must be one of "
                             f"{[s.value for s in ShardingStrategy]}, got "
                             f"{sharding_strategy!r}") from None
        if not chunk_size_mb > 0:
            raise ValueError(f"FullyShardedDataParallel (rank {rank}): argument "
                             f"'chunk_size_mb' must be > 0, got {chunk_size_mb!r}")
        self.mixed_precision = mixed_precision
        param_dtype = _dtype(mixed_precision, "param_dtype", rank)
        self._reduce_dtype = _dtype(mixed_precision, "reduce_dtype", rank) or param_dtype
        buffer_dtype = _dtype(mixed_precision, "buffer_dtype", rank)
        if group is not None and process_group is not None:
            raise ValueError(f"FullyShardedDataParallel (rank {rank}): pass 'group' or "
                             f"'process_group', not both")
        parent = resolve_group(group if group is not None else process_group,
                               "FullyShardedDataParallel")
        self.module = module
        # Gathers (caller's thread) and gradient exchanges (communication thread) each on a
        # communicator of their own.
        self.process_group = new_group(parent=parent)
        self._reduce_group = new_group(parent=parent)
        self.rank, self.world_size = self.process_group.rank, self.process_group.size
        if sync_module_states:
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    broadcast(t.detach(), 0, self.process_group)
        self._group_options, group_of = _state.parse_param_groups(module, param_groups, rank)
        shards = 1 if self.sharding_strategy is ShardingStrategy.NO_SHARD else self.world_size
        cap = max(1, int(chunk_size_mb * (1 << 20)))
        chunks = plan(module, cap, shards, self.rank, group_of,
                      keep_full=self.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP,
                      compute_dtype=param_dtype)
        self._param_dtype = param_dtype
        if buffer_dtype is not None:
            for m in module.modules():
                for name, b in m._buffers.items():
                    if b is not None and b.is_floating_point():
                        m._buffers[name] = b.to(buffer_dtype)
        self._chunks: list[Chunk] = chunks
        self._gathered_bytes = [0, 0]      # gathered chunks now, and their peak
        for c in chunks:
            c.tracker = self._gathered_bytes
            if c.shards > 1:
                self._gathered_bytes[0] += c.padded * c.full.element_size()
        self._names = _state.record_names(module)
        detach_parameters(chunks)
        self._flat_params = nn.ParameterList([c.shard for c in chunks])
        self._by_full = {id(c.full): c for c in chunks}
        self._owned = owned_chunks(chunks)
        self._full_shard = self.sharding_strategy is ShardingStrategy.FULL_SHARD
        if self._full_shard:
            for c in chunks:
                c.free()
        self._gathered_bytes[1] = self._gathered_bytes[0]
        threaded = runtime.thread_multiple()
        if not threaded:
            warnings.warn("commlib: MPI lacks MPI_THREAD_MULTIPLE; gradient exchange will not "
                          "overlap with backward", RuntimeWarning, stacklevel=2)
        self._engine = Engine(threaded, name="commlib-fsdp")
        # Gathers run on a thread of their own (so a prefetched chunk arrives while the
        # caller computes), in the order the caller requests them, identical on every rank.
        self._gather_engine = Engine(threaded, name="commlib-fsdp-gather")
        self._inflight: dict[int, tuple[Any, int]] = {}   # chunk -> (future, shard version)
        self._recv_pool: dict[tuple, list[torch.Tensor]] = {}
        self.prefetch = 1 if self._full_shard else len(chunks)
        self._order: list[int] | None = None   # chunks in first-use order (first forward)
        self._order_rec: list[int] = []
        self._saved: set[int] = set()          # chunks autograd saved views of
        self._sync = True
        self._pending: list[tuple[Chunk, Any]] = []
        self._backward_started = False
        self._handles = [c.full.register_post_accumulate_grad_hook(self._on_grad)
                         for c in chunks if c.requires_grad]
        self._last_use: dict[int, int] | None = None   # chunk index -> post-hook sequence
        self._seq = 0
        self._active: dict[int, int] = {}
        self._fresh: set[int] = set()
        if self.sharding_strategy is not ShardingStrategy.NO_SHARD:
            for m in {id(m): m for c in chunks for m in c.modules}.values():
                self._handles.append(m.register_forward_pre_hook(self._pre_forward))
                self._handles.append(m.register_forward_hook(self._post_forward))
        self._closed = False

    def _run(self, fn: Any, *args: Any) -> Any:
        """Run a collective on the gather communicator, after the gathers queued before."""
        return self._gather_engine.submit(fn, *args).result()

    # -- forward ------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward, with the chunks it uses gathered (see the class doc)."""
        if self._backward_started:   # the last backward raised: drop what it exchanged
            pending, self._pending = self._pending, []
            self._backward_started = False
            for _, future in pending:
                future.exception()
        self._seq = 0
        self._active = {}
        self._recording: dict[int, int] = {}
        self._fresh = set()   # FULL_SHARD: chunks whose views this forward made
        self._saved = set()
        if self._param_dtype is not None:
            args, kwargs = _cast((args, kwargs), self._param_dtype)
        if not self._full_shard:
            # SHARD_GRAD_OP: every chunk whose shard changed is re-gathered, all requests
            # at once; each module waits for its own chunks in its pre-hook
            for i in self._order or range(len(self._chunks)):
                c = self._chunks[i]
                if c.shards == 1 and c.stale():
                    self._gather(c)   # NO_SHARD: mixed precision's cast copy, at once
                self._request(c)
            for c in self._chunks:
                c.set_views()
            try:
                return self.module(*args, **kwargs)
            finally:
                for c in self._chunks:
                    if c.stale():
                        self._gather(c)
                if self._order is None:
                    self._order = self._order_rec
        try:
            if self._order is not None and self._order:
                self._request(self._chunks[self._order[0]])
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return self.module(*args, **kwargs)
        finally:
            for c in self._chunks:
                c.free()
            if self._last_use is None:
                self._last_use = dict(self._recording)
                self._order = self._order_rec

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
        future = self._gather_engine.submit(allgather, send, self.process_group, True, out)
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

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        for c in self._owned.get(id(module), ()):
            self._active[c.index] = self._active.get(c.index, 0) + 1
            if c.stale():
                self._gather(c)
                if self._full_shard:
                    self._prefetch_after(c, 1)
            if self._full_shard and c.index not in self._fresh:
                c.set_views()   # under this forward's grad mode, on gathered memory
                self._fresh.add(c.index)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._full_shard:
            return
        self._seq += 1
        first = self._last_use is None
        for c in self._owned.get(id(module), ()):
            self._active[c.index] -= 1
            if first:
                self._recording[c.index] = self._seq
            elif self._last_use.get(c.index) == self._seq and not self._active[c.index]:
                c.free()

    def _pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._base is not None else t
        chunk = self._by_full.get(id(base))
        if chunk is not None:
            self._saved.add(chunk.index)
        return chunk, t

    def _unpack(self, packed: Any) -> torch.Tensor:
        chunk, t = packed
        if chunk is not None and not chunk.gathered:
            self._gather(chunk)
            self._prefetch_after(chunk, -1)
        return t

    # -- backward -----------------------------------------------------------------------
    def _on_grad(self, full: torch.Tensor) -> None:
        c = self._by_full[id(full)]
        if not self._backward_started:
            self._backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if self._full_shard:
            c.free()
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
        return reduce_scatter(grad, ReduceOp.AVG, self._reduce_group, async_op=True)

    def _end_backward(self) -> None:
        pending, self._pending = self._pending, []
        self._backward_started = False
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
                c.free()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate full (unsharded) gradients without any
        exchange; the first backward outside exchanges their sum."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # -- utilities ------------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the shards' gradients so that the global gradient norm (over all ranks'
        shards, i.e. the whole model, each parameter once) is at most ``max_norm``.
        Returns the norm before clipping (float64 tensor, the same on every rank)."""
        norm_type = float(norm_type)
        grads = [c.shard.grad for c in self._chunks if c.shard.grad is not None]
        sharded = self.sharding_strategy is not ShardingStrategy.NO_SHARD
        if norm_type == float("inf"):
            local = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
            total = torch.tensor([local], dtype=torch.float64)
            if sharded:
                self._run(allreduce, total, ReduceOp.MAX, self.process_group)
            total = total[0]
        else:
            local = sum(float(torch.linalg.vector_norm(g.double(), norm_type) ** norm_type)
                        for g in grads)
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
        named; pass it to a ``torch.optim`` optimizer."""
        return _state.sharded_param_groups(self._chunks, self._group_options)

    def memory_bytes(self, reset_peak: bool = False) -> dict[str, int]:
        """Bytes this rank holds now: ``params`` (shards plus gathered chunks, the shard
        counted once where it is a slice of a gathered chunk), ``grads`` (shard gradients
        plus full gradients still held) and ``peak_gathered`` (the most bytes of gathered
        FULL_SHARD chunks held at once since construction or the last ``reset_peak=True``;
        a gather's receive buffer, one chunk per request under way, comes on top)."""
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
        out = {"params": params, "grads": grads, "peak_gathered": self._gathered_bytes[1]}
        if reset_peak:
            self._gathered_bytes[1] = self._gathered_bytes[0]
        return out

    # -- state dicts --------------------------------------------------------------------
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> dict:
        """The full, unsharded module state (``module.state_dict()``'s keys and order,
        parameters as the module's shapes) on every rank. Collective over the group."""
        return _state.full_state_dict(self, prefix)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a full state (from :meth:`state_dict`, saved at any world size and
        strategy) into this rank's shards and the module's buffers; every rank passes the
        same values. Returns torch's ``(missing_keys, unexpected_keys)``."""
        return _state.load_full_state_dict(self, state_dict, strict)

    @staticmethod
    def optim_state_dict(model: "FullyShardedDataParallel",
                         optim: torch.optim.Optimizer) -> dict:
        """The optimizer's full state keyed by parameter name (element-wise state gathered
        from the shards), on every rank; loads at any world size through
        :meth:`optim_state_dict_to_load`. Collective over the group."""
        return _state.full_optim_state_dict(model, optim)

    @staticmethod
    def optim_state_dict_to_load(model: "FullyShardedDataParallel",
                                 optim: torch.optim.Optimizer, optim_state_dict: dict) -> dict:
        """This rank's optimizer state dict (for ``optim.load_state_dict``) cut from a full
        one made by :meth:`optim_state_dict`."""
        return _state.shard_optim_state_dict(model, optim, optim_state_dict)

    def close(self) -> None:
        """Remove the hooks and stop the communication thread (idempotent)."""
        if not self._closed:
            self._closed = True
            for h in self._handles:
                h.remove()
            for future, _ in self._inflight.values():
                future.result()
            self._inflight = {}
            self._engine.close()
            self._gather_engine.close()

    def __del__(self) -> None:
        try:
            self._engine.close(timeout=1.0)
            self._gather_engine.close(timeout=1.0)
        except Exception:  # noqa: BLE001
            pass

    def extra_repr(self) -> str:
        return (f"sharding_strategy={self.sharding_strategy.value}, chunks={len(self._chunks)}, "
                f"rank={self.rank}, world_size={self.world_size}")


def _dtype(mixed_precision: Any, name: str, rank: int) -> torch.dtype | None:
    """``mixed_precision.<name>`` (torch's ``MixedPrecision`` or commlib's, or a dict)."""
    if mixed_precision is None:
        return None
    value = (mixed_precision.get(name) if isinstance(mixed_precision, dict)
             else getattr(mixed_precision, name, None))
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(f"FullyShardedDataParallel (rank {rank}): mixed_precision.{name} must "
                        f"be a floating-point torch.dtype or None, got {value!r}")
    return value


def _cast(obj: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors inside ``obj`` (tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_cast(o, dtype) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj
