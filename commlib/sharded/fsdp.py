"""``commlib.FullyShardedDataParallel``: ZeRO stages 2 and 3 over flat parameter chunks.

Strategies (torch FSDP's names):

* ``NO_SHARD``: every rank keeps whole chunks; gradients are allreduced (plain DP).
* ``SHARD_GRAD_OP`` (ZeRO-2): every rank keeps the gathered chunks between steps; after
  backward each chunk's gradient is reduce-scattered (averaged) into this rank's shard and
  the full gradient released; before the next forward, chunks whose shard changed (an
  optimizer step, a load) are all-gathered again.
* ``FULL_SHARD`` (ZeRO-3): a chunk is all-gathered just before the first module that uses
  it runs (forward pre-hooks, ahead of the user's), released after the last one (learned in
  the first forward; the release waits until the module's own forward hooks have run),
  gathered again during backward when autograd needs a saved parameter (saved-tensor
  hooks), and released once its gradient has been reduce-scattered. A parameter used
  outside its module (``h @ self.emb.weight.t()`` in the root's forward) is gathered at that
  use and its chunk kept for the rest of every forward of the wrapper (as torch's
  ``fully_shard`` keeps a group for its module's whole forward); a use outside the
  wrapper's forward raises naming the parameter.

Wrappers nest (blocks first, then the root: torch's auto-wrap pattern): a wrapper shards
the parameters of the modules not inside a nested wrapper and leaves the rest to those.

Gradient exchanges start as soon as autograd has accumulated a chunk's gradient
(post-accumulate-grad hook) and run on a communication thread (the DDP engine), on a
communicator of their own; gathers run on a second thread on another communicator
(FULL_SHARD prefetches the next chunk in first-use order, forward and backward), each
stream in an order every rank shares. ``backward()`` returns once every shard's ``.grad``
holds its averaged gradient.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from ..core import runtime
from ..ddp.engine import Engine
from ..primitives import allgather, new_group
from . import nesting
from . import state as _state
from .chunks import Chunk, detach_parameters, owned_chunks, plan, scope
from .config import ShardingStrategy, check_layout, mixed_precision_dtype, strategy_of
from .groups import resolve_group, wait_poll_s
from .quantized import DEFAULT_BLOCK, Hierarchy, node_group, quantization_blocks
from .stream import FULLS, ChunkSchedule
from .utilities import WrapperUtilities, broadcast_coalesced, full_chunk


class FullyShardedDataParallel(ChunkSchedule, WrapperUtilities, nn.Module):
    """Shard ``module``'s parameters in flat chunks across the ranks of ``group``.

    Collective over ``group`` (``None``: the world; a ``commlib.Group`` or a torch
    ``ProcessGroup``; ``process_group=`` is torch's name). At construction rank 0's
    parameters and buffers are broadcast, parameters are packed into chunks of about
    ``chunk_size_mb`` MiB (same dtype, device, ``requires_grad`` and entry of
    ``param_groups``; zero-padded to a multiple of the group size), and each rank keeps its
    1/N slice as an ``nn.Parameter``: :meth:`parameters` yields only these shards (1-D, the
    chunk's dtype; a nested wrapper's too), so a ``torch.optim`` optimizer built over them
    holds 1/N of the state. The module's own parameters become plain tensors (views into
    the gathered chunks; under FULL_SHARD, between uses, placeholders that name the
    parameter if used outside the wrapper's forward).

    Nesting: modules inside a ``FullyShardedDataParallel`` already (wrap blocks first,
    then the root) are left to it: their parameters, shards and buffers are neither
    broadcast nor chunked again, and ``no_sync``, ``clip_grad_norm_``, ``close`` and the
    optimizer state dicts cover the nested wrappers too. ``ValueError`` on every rank for
    what cannot nest: a nested wrapper on other ranks or closed, a module both inside and
    outside a nested wrapper, a parameter tied across two wrappers (torch's ``fully_shard``
    refuses it too), a module of an existing wrapper's scope wrapped again.

    ``state_dict()`` (and the state dict of any model holding the wrapper, at any depth) has
    exactly the keys of the unwrapped module, with full values on every rank; it and
    ``load_state_dict`` follow torch's module protocol (hooks) and are collective.

    ``param_groups``: optional list of dicts ``{"params": [module parameters or names],
    **options}`` for optimizers with several param groups: chunks never mix two entries;
    :meth:`sharded_param_groups` returns the same dicts over the shards. Every rank must
    run the same forward and backward (the same chunks get gradients) each step.
    ``mixed_precision``: a :class:`MixedPrecision` (or torch's): compute in
    ``param_dtype`` (half the bytes gathered), reduce in ``reduce_dtype``, keep the shards
    and the optimizer in the parameters' dtype.

    Compressed sharding (ZeRO++, see :mod:`commlib.sharded.quantized`): the master shards
    and the optimizer stay in full precision; only what crosses the wire is quantized, in
    min-max 8-bit blocks of ``quantization_block_size`` elements (one byte an element plus
    8 bytes of ``(min, max)`` a block), each element within ``(max - min) / 510`` of its
    block. ``weight_quantization="int8"`` (qwZ, FULL_SHARD only): every gather of a chunk
    (forward and backward) sends the shard quantized; every rank decodes the same values,
    so the replicas compute with identical weights (state dicts stay exact).
    ``gradient_quantization="int8"`` or ``"int4"`` (qgZ, FULL_SHARD or SHARD_GRAD_OP; int4:
    15 levels, two codes a byte, within ``(max - min) / 30``, an even block size): a
    chunk's gradient is reduce-scattered through one ``alltoall`` of quantized parts,
    decoded and summed in float64; with ``gradient_hierarchy="node"`` (ZeRO++'s
    hierarchical qgZ) the parts are first reduced inside the node in full precision
    (``reduce_scatter``), then only the node sums cross nodes, quantized (``k`` parts a
    rank for ``k`` nodes instead of ``n``; nodes as for ``secondary_shard``). ``secondary_shard="node"`` (hpZ, FULL_SHARD only): each forward
    gather also leaves this rank its ``1/m`` slice of the chunk among the ``m`` ranks of
    its node (``COMMLIB_LOCAL_SIZE`` blocks, else the host; nodes of equal size), so the
    backward re-gathers run inside the node only, on exactly the forward's values; costs
    ``padded / m`` elements of the compute dtype per chunk, held from a chunk's forward
    gather until the shard changes (``memory_bytes()["secondary"]``). ``ValueError``
    naming the argument for any other value.

    Two private communicators are released by :meth:`close` (also at garbage collection;
    MPI has about 2000: call ``close()`` when a wrapper is replaced).
    """

    def __init__(self, module: nn.Module, sharding_strategy: str | ShardingStrategy =
                 ShardingStrategy.FULL_SHARD, group: Any = None, *,
                 process_group: Any = None, chunk_size_mb: float = 4.0,
                 param_groups: list[dict] | None = None, mixed_precision: Any = None,
                 sync_module_states: bool = True, weight_quantization: str | None = None,
                 gradient_quantization: str | None = None,
                 quantization_block_size: int = DEFAULT_BLOCK,
                 secondary_shard: str | None = None,
                 gradient_hierarchy: str | None = None) -> None:
        super().__init__()
        self._closed = True   # until the communicators exist
        rank = runtime.get_rank()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel (rank {rank}): argument 'module' must "
                            f"be a torch.nn.Module, got {type(module).__name__}")
        self.sharding_strategy = strategy_of(sharding_strategy, rank)
        check_layout(self.sharding_strategy, chunk_size_mb, secondary_shard, rank)
        self._weight_block, self._grad_block = quantization_blocks(
            self.sharding_strategy.value, weight_quantization, gradient_quantization,
            quantization_block_size, rank, gradient_hierarchy)
        self.weight_quantization, self.gradient_quantization = (weight_quantization,
                                                                gradient_quantization)
        self.gradient_hierarchy = gradient_hierarchy
        self._hierarchy = None
        self.secondary_shard = secondary_shard
        self._node_group = None
        self.mixed_precision = mixed_precision
        param_dtype = mixed_precision_dtype(mixed_precision, "param_dtype", rank)
        self._reduce_dtype = mixed_precision_dtype(mixed_precision, "reduce_dtype", rank) or param_dtype
        buffer_dtype = mixed_precision_dtype(mixed_precision, "buffer_dtype", rank)
        if group is not None and process_group is not None:
            raise ValueError(f"FullyShardedDataParallel (rank {rank}): pass 'group' or "
                             f"'process_group', not both")
        parent = resolve_group(group if group is not None else process_group,
                               "FullyShardedDataParallel")
        self.module = module
        if isinstance(module, FullyShardedDataParallel):
            inside, nested = [], [("", module)]
        else:
            inside, nested = scope(module, lambda m: isinstance(m, FullyShardedDataParallel))
        # Gathers (caller's thread) and gradient exchanges (communication thread) each on a
        # communicator of their own.
        self.process_group = new_group(parent=parent)
        self._reduce_group = new_group(parent=parent)
        self._closed = False
        self.rank, self.world_size = self.process_group.rank, self.process_group.size
        try:
            if secondary_shard:
                self._node_group = node_group(self.process_group)
            if gradient_hierarchy:
                self._hierarchy = Hierarchy(self._reduce_group)
            self._agree(nesting.refusal(inside, nested, self.process_group.ranks))
            self._setup(inside, nested, param_groups, param_dtype, buffer_dtype,
                        chunk_size_mb, sync_module_states)
        except BaseException:
            self._closed = True
            self.process_group.free()
            self._reduce_group.free()
            if self._node_group is not None:
                self._node_group.free()
            if self._hierarchy is not None:
                self._hierarchy.free()
            raise

    def _agree(self, refusal: str | None) -> None:
        """Raise ``ValueError`` on every rank if any rank refuses the module."""
        flags = allgather(np.array([refusal is not None], dtype=np.int64), self.process_group)
        if refusal is not None:
            raise ValueError(f"FullyShardedDataParallel (rank {self.rank}): {refusal}")
        if flags.any():
            raise ValueError(f"FullyShardedDataParallel (rank {self.rank}): rank(s) "
                             f"{[int(r) for r in np.flatnonzero(flags)]} of the group refused "
                             f"the module (see their error)")

    def _setup(self, inside: list, nested: list, param_groups: Any, param_dtype: Any,
               buffer_dtype: Any, chunk_size_mb: float, sync_module_states: bool) -> None:
        module, rank = self.module, self.rank
        unique = list({id(m): m for _, m in inside}.values())
        own = list({id(p): p for m in unique for p in m._parameters.values()
                    if p is not None}.values())
        buffers = list({id(b): b for m in unique for b in m._buffers.values()
                        if b is not None}.values())
        if sync_module_states and self.world_size > 1:
            broadcast_coalesced(own + buffers, self.process_group)
        self._group_options, group_of = _state.parse_param_groups(
            module, param_groups, rank, {id(p) for p in own})
        shards = 1 if self.sharding_strategy is ShardingStrategy.NO_SHARD else self.world_size
        cap = max(1, int(chunk_size_mb * (1 << 20)))
        chunks = plan(inside, cap, shards, rank, group_of,
                      keep_full=self.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP,
                      compute_dtype=param_dtype)
        self._param_dtype = param_dtype
        if buffer_dtype is not None:
            for m in unique:
                for name, b in m._buffers.items():
                    if b is not None and b.is_floating_point():
                        m._buffers[name] = b.to(buffer_dtype)
        self._chunks: list[Chunk] = chunks
        self._nested = [(name, w) for name, w in nested]
        self._gathered_bytes = [0, 0]      # gathered chunks now, and their peak
        me = weakref.ref(self)
        for c in chunks:
            c.tracker = self._gathered_bytes
            c.owner = me
            FULLS[id(c.full)] = c
            if c.shards > 1:
                self._gathered_bytes[0] += c.padded * c.full.element_size()
        names = _state.record_names(unique)
        detach_parameters(chunks)
        nesting.register(chunks, self)
        self._flat_params = nn.ParameterList([c.shard for c in chunks])
        self._by_full = {id(c.full): c for c in chunks}
        self._owned = owned_chunks(chunks)
        self._full_shard = self.sharding_strategy is ShardingStrategy.FULL_SHARD
        self._fresh: set[int] = set()      # FULL_SHARD: chunks whose views this forward made
        if self._full_shard:
            for c in chunks:
                self._free(c)
        self._gathered_bytes[1] = self._gathered_bytes[0]
        threaded = runtime.thread_multiple()
        if not threaded:
            warnings.warn("commlib: MPI lacks MPI_THREAD_MULTIPLE; gradient exchange will not "
                          "overlap with backward", RuntimeWarning, stacklevel=3)
        poll_s = wait_poll_s()
        self._engine = Engine(threaded, name="commlib-fsdp", poll_s=poll_s)
        # Gathers run on a thread of their own (so a prefetched chunk arrives while the
        # caller computes), in the order the caller requests them, identical on every rank.
        self._gather_engine = Engine(threaded, name="commlib-fsdp-gather", poll_s=poll_s)
        self._inflight: dict[int, tuple[Any, int]] = {}   # chunk -> (future, shard version)
        # hpZ: chunk -> (this rank's slice of the node's copy, shard version it was made at)
        self._secondary: dict[int, tuple[torch.Tensor, int]] = {}
        self._recv_pool: dict[tuple, list[torch.Tensor]] = {}
        self.prefetch = 1 if self._full_shard else len(chunks)
        self._order: list[int] | None = None   # chunks in first-use order (first forward)
        self._order_rec: list[int] = []
        self._saved: set[int] = set()          # chunks autograd saved views of
        self._sync = True
        self._pending: list[tuple[Chunk, Any]] = []
        self._backward_started = False
        self._end_queued = False
        self._in_forward = False
        self._pinned: set[int] = set()   # used outside their modules: kept for the forward
        self._releasable: list[Chunk] = []
        self._handles = [c.full.register_post_accumulate_grad_hook(self._on_grad)
                         for c in chunks if c.requires_grad]
        self._last_use: dict[int, int] | None = None   # chunk index -> post-hook sequence
        self._seq = 0
        self._active: dict[int, int] = {}
        if self.sharding_strategy is not ShardingStrategy.NO_SHARD:
            for m in {id(m): m for c in chunks for m in c.modules}.values():
                # ahead of the user's pre-hooks (weight_norm's, parametrizations'), as FSDP2
                self._handles.append(m.register_forward_pre_hook(self._pre_forward,
                                                                 prepend=True))
                self._handles.append(m.register_forward_hook(self._post_forward))
        self._state_hooks = _state.FullStateHooks(self, "module", chunks, names,
                                                  full_chunk, self._restore)

    def __getattr__(self, name: str) -> Any:
        """Attributes the wrapper lacks are the wrapped module's (as torch's FSDP does), so
        code written for the unwrapped model (``self.emb.weight``) keeps working."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if name == "module" or "module" not in modules:
                raise
            return getattr(modules["module"], name)

    def __getitem__(self, key: Any) -> Any:
        """Indexing reaches the wrapped module (an ``nn.Sequential``, a ``ModuleList``)."""
        return self.module.__getitem__(key)

    def _run(self, fn: Any, *args: Any) -> Any:
        """Run a collective on the gather communicator, after the gathers queued before."""
        if self._closed:
            raise RuntimeError(f"FullyShardedDataParallel (rank {self.rank}): the wrapper "
                               f"was closed")
        return self._gather_engine.submit(fn, *args).result()

    def _wrappers(self) -> list[FullyShardedDataParallel]:
        """This wrapper and every wrapper nested in it, outermost first."""
        out = [self]
        for _, w in self._nested:
            out += w._wrappers()
        return out

    def _named_chunks(self) -> list[tuple[Chunk, list[str]]]:
        """(chunk, its slots' names in the unwrapped module) for this wrapper's chunks and
        every nested wrapper's."""
        out = [(c, [s.name for s in c.slots]) for c in self._chunks]
        for name, w in self._nested:
            out += [(c, [f"{name}.{n}" if name else n for n in names])
                    for c, names in w._named_chunks()]
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward, with the chunks it uses gathered (see the class doc)."""
        if self._closed:
            raise RuntimeError(f"FullyShardedDataParallel (rank {self.rank}): forward after "
                               f"close()")
        return self._forward_chunks(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate full (unsharded) gradients without any
        exchange (nested wrappers' too); the first backward outside exchanges their sum."""
        wrappers = self._wrappers()
        old = [w._sync for w in wrappers]
        for w in wrappers:
            w._sync = False
        try:
            yield
        finally:
            for w, s in zip(wrappers, old):
                w._sync = s

    def close(self) -> None:
        """Remove the hooks, stop the communication threads and free the two
        communicators, of this wrapper and of the wrappers nested in it (idempotent; not
        collective). Forward and state dicts that need communication raise afterwards."""
        for _, w in self._nested:
            w.close()
        self._shutdown(None)

    def _shutdown(self, timeout: float | None) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for h in getattr(self, "_handles", ()):
            h.remove()
        if hasattr(self, "_engine"):
            for future, _ in self._inflight.values():
                future.exception(timeout)
            self._inflight = {}
            stopped = self._engine.close(timeout) & self._gather_engine.close(timeout)
            if not stopped:
                return   # a thread still inside MPI (at exit): leave its communicator be
        self.process_group.free()
        self._reduce_group.free()
        if self._node_group is not None:
            self._node_group.free()
        if self._hierarchy is not None:
            self._hierarchy.free()

    def __del__(self) -> None:
        try:
            self._shutdown(1.0)
        except Exception:  # noqa: BLE001 (MPI may already be finalized at exit)
            pass

    def extra_repr(self) -> str:
        quant = "".join(f", {k}={v!r}" for k, v in (
            ("weight_quantization", self.weight_quantization),
            ("gradient_quantization", self.gradient_quantization),
            ("gradient_hierarchy", self.gradient_hierarchy)) if v)
        return (f"sharding_strategy={self.sharding_strategy.value}, chunks={len(self._chunks)}, "
                f"rank={self.rank}, world_size={self.world_size}{quant}")
