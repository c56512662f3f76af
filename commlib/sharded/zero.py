"""``commlib.ZeroRedundancyOptimizer``: ZeRO stage 1 (optimizer state sharded across ranks).

The trainable parameters are partitioned evenly as one flat space per dtype and device
(:mod:`commlib.sharded.flat_partition`): rank ``r`` owns ``floor(T / N)`` or
``ceil(T / N)`` of the ``T`` elements, cut inside parameters where bucket boundaries fall,
and builds ``optimizer_class`` over flat shards of its elements (one per param group and
kind), so it holds and updates exactly 1/N of the optimizer state. After its local step
the updated elements travel to every rank in one ``allgather`` per dtype and device.

Gradients: by default they must already be averaged when ``step()`` runs (by
:class:`commlib.DistributedDataParallel`, or by the caller), as for torch's
``ZeroRedundancyOptimizer``: a step then costs DDP's allreduce plus the all-gather.
``reduce_gradients=True`` (DeepSpeed stage 1, no DDP): each bucket's gradients are
reduce-scattered (averaged) as soon as backward has accumulated them, overlapped with the
rest of backward, so a step's bytes are an allreduce's (reduce-scatter per bucket plus the
all-gather, padded to ``ceil(T / N)`` elements a rank).
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..base.reduce_ops import ReduceOp
from ..core import runtime
from ..ddp.engine import Engine
from ..primitives import allgather, allreduce, broadcast, new_group, reduce_scatter
from . import flat_partition as fp
from . import zero_state
from .groups import resolve_group, wait_poll_s
from .zero_checkpoint import ZeroStateDict, _hyper

#: Largest all-gather of updated values (bytes received by a rank); beyond it the local
#: flats travel in several segments.
GATHER_CAP_BYTES = 256 << 20


class ZeroRedundancyOptimizer(ZeroStateDict, torch.optim.Optimizer):
    """Wrap ``optimizer_class`` so that each rank of ``group`` keeps the state of 1/N of
    the parameters' elements.

    ``params``: tensors or param-group dicts, as for any ``torch.optim`` optimizer; every rank
    of ``group`` passes the same parameters (same order, shapes, dtypes; contiguous).
    ``group``: a ``commlib.Group`` or a torch ``ProcessGroup`` (``process_group=`` is the
    torch name); ``None`` is the world. Collective over ``group`` at construction (a private
    communicator is made), in :meth:`step`, :meth:`add_param_group`,
    :meth:`consolidate_state_dict` and, with ``reduce_gradients``, in backward.

    ``optimizer_class`` must be element-wise (SGD, Adam, AdamW, RMSprop, Adagrad...: each
    element's update depends on that element only), since it steps flat shards that cut
    through parameters; every trainable parameter's elements step each step (a ``None``
    gradient counts as zeros, as in a flat-buffer optimizer). Parameters with
    ``requires_grad=False`` at construction are not partitioned and never step.

    ``reduce_gradients`` (commlib's; default False, torch's behaviour): backward hooks
    reduce-scatter the gradients bucket by bucket (``bucket_cap_mb`` MiB a bucket, torch
    DDP's name), the average landing in this rank's shard; wrap the model in no DDP.
    Rank 0's parameter values are broadcast at construction (DDP's job otherwise);
    :meth:`no_sync` skips the exchange for gradient accumulation; each parameter's
    ``.grad`` keeps this rank's local (not averaged) gradient. Without it, the gradients'
    averaged values are read at ``step()``.

    ``param_groups`` are the global groups (all parameters); schedulers and the user change
    their hyper-parameters, which are handed to the local optimizer at each step. After
    ``step()``, every parameter holds the updated value on every rank (bitwise).
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
                 overlap_with_ddp: bool = False, *, reduce_gradients: bool = False,
                 bucket_cap_mb: float = 25.0, **defaults: Any) -> None:
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
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or not bucket_cap_mb > 0:
            raise ValueError(f"ZeroRedundancyOptimizer (rank {rank}): argument "
                             f"'bucket_cap_mb' must be a number > 0, got {bucket_cap_mb!r}")
        self._initialized = False
        self._closed = True   # until the communicator exists
        self._optimizer_class = optimizer_class
        self._defaults = dict(defaults)
        self.reduce_gradients = bool(reduce_gradients)
        self._bucket_bytes = max(1, int(bucket_cap_mb * (1 << 20)))
        super().__init__(params, defaults)
        for g in self.param_groups:
            for p in g["params"]:
                if not p.is_contiguous():
                    raise ValueError(f"ZeroRedundancyOptimizer (rank {rank}): argument "
                                     f"'params' must hold contiguous tensors, got one of "
                                     f"shape {tuple(p.shape)} and strides {p.stride()}")
        parent = resolve_group(group if group is not None else process_group,
                               "ZeroRedundancyOptimizer")
        self.process_group = new_group(parent=parent)
        self._closed = False
        self._hooks: list[Any] = []
        self._sync = True
        try:
            self.rank = self.process_group.rank
            self.world_size = self.process_group.size
            self._all_state_dicts: list[dict] = []
            threaded = runtime.thread_multiple()
            if self.reduce_gradients and not threaded:
                warnings.warn("commlib: MPI lacks MPI_THREAD_MULTIPLE; gradient exchange will "
                              "not overlap with backward", RuntimeWarning, stacklevel=2)
            self._engine = Engine(threaded, name="commlib-zero", poll_s=wait_poll_s())
            self._partition()
            self.optim = self._local_optimizer()
            if self.reduce_gradients:
                self._broadcast_parameters()
                self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                               for kind in self._kinds for p in kind.params]
        except BaseException:
            self.close()
            raise
        self._fill_defaults(range(len(self.param_groups)))
        self._initialized = True

    def regroup(self, group: Any, full: dict[int, dict] | None = None) -> None:
        """Collective over ``group``, the group training goes on over (the survivors of a
        failure, :mod:`commlib.elastic`): release the old communicator (its collectives
        may have failed), partition the parameters over ``group`` and take the state of
        the elements this rank owns now from ``full`` (global position -> state, as
        ``commlib.sharded.zero_state.full_state`` builds it; ``None``: no state). The
        parameters' values are not touched (every member holds the same already)."""
        self.close()
        parent = resolve_group(group, "ZeroRedundancyOptimizer.regroup")
        self.process_group = new_group(parent=parent)
        self._closed = False
        self.rank = self.process_group.rank
        self.world_size = self.process_group.size
        self._all_state_dicts = []
        self._grads_ready = False
        self._engine = Engine(runtime.thread_multiple(), name="commlib-zero",
                              poll_s=wait_poll_s())
        self._partition()
        self.optim = self._local_optimizer()
        if full:
            self._load_local(full)
        if self.reduce_gradients:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                           for kind in self._kinds for p in kind.params]

    def _fill_defaults(self, indices: Iterable[int]) -> None:
        """Give the global groups ``indices`` the local optimizer's options they lack (its
        defaults; every rank's local optimizer has every group, possibly empty)."""
        for i in indices:
            for key, value in self.optim.param_groups[i].items():
                if key != "params":
                    self.param_groups[i].setdefault(key, value)

    def close(self) -> None:
        """Release the private communicator and the backward hooks (idempotent; not
        collective). The optimizer cannot step, consolidate or load afterwards."""
        if not getattr(self, "_closed", True):
            self._closed = True
            for h in self._hooks:
                h.remove()
            self._hooks = []
            engine = getattr(self, "_engine", None)
            if engine is not None and not engine.close(None):
                return   # a thread still inside MPI: leave its communicator be
            self.process_group.free()

    def __enter__(self) -> ZeroRedundancyOptimizer:
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
        """The flat partition of the current param groups: per kind, this rank's local
        flat of values and of gradients, and the shards (views of the values) per group."""
        groups = [list(g["params"]) for g in self.param_groups]
        self._kinds = fp.plan(groups, self.world_size, self._bucket_bytes)
        self._values, self._grads, self._local_pieces = [], [], []
        # the updated values' all-gathers: (lo, width, each rank's pieces in the segment)
        self._segments = []
        for kind in self._kinds:
            n = kind.local_numel[self.rank]
            self._values.append(torch.zeros(n, dtype=kind.dtype, device=kind.device))
            self._grads.append(torch.zeros(n, dtype=kind.dtype, device=kind.device))
            every = [kind.local_pieces(r) for r in range(self.world_size)]
            self._local_pieces.append(every[self.rank])
            cap = GATHER_CAP_BYTES // (kind.params[0].element_size() * self.world_size)
            self._segments.append([(lo, w, [fp.clip(every[r], lo, lo + w)
                                            for r in range(self.world_size)])
                                   for lo, w in fp.gather_segments(kind, cap)])
        self._mine: list[list[torch.nn.Parameter]] = []
        for g, shards in enumerate(zero_state.shards_of(self._kinds, len(groups), self.rank)):
            self._mine.append([torch.nn.Parameter(self._values[k][lo:hi])
                               for k, lo, hi in shards])
        self._shard_grads = [[self._grads[k][lo:hi] for k, lo, hi in shards] for shards in
                             zero_state.shards_of(self._kinds, len(groups), self.rank)]
        self.shard_numel = [sum(kind.local_numel[r] for kind in self._kinds)
                            for r in range(self.world_size)]
        # backward exchange: buckets in launch order (last first, as backward fills them)
        self._order = [(k, b.index) for k in reversed(range(len(self._kinds)))
                       for b in reversed(self._kinds[k].buckets)]
        self._new_round()

    def _local_optimizer(self) -> torch.optim.Optimizer:
        params_here = [{**_hyper(g), "params": mine}
                       for g, mine in zip(self.param_groups, self._mine)]
        return self._optimizer_class(params_here, **self._defaults)

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (on every rank, the same; collective once the optimizer has
        state): the flat partition is made again over all groups and the state so far
        moves to the elements' new owners."""
        super().add_param_group(param_group)
        if not self._initialized:
            return
        self._check_open("add_param_group")
        self._drain()
        old_groups = [list(g["params"]) for g in self.param_groups[:-1]]
        full = None
        if self.optim.state:
            full = zero_state.full_state(self._kinds, old_groups, self._every_local_state())
        self._partition()
        self.optim = self._local_optimizer()
        self._fill_defaults([len(self.param_groups) - 1])
        if full:
            self._load_local(full)
        if self.reduce_gradients:
            for h in self._hooks:
                h.remove()
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                           for kind in self._kinds for p in kind.params]

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        """Rank 0's values of the partitioned parameters, one broadcast per kind."""
        if self.world_size == 1:
            return
        for kind in self._kinds:
            flat = torch.cat([p.detach().reshape(-1) for p in kind.params])
            broadcast(flat, 0, self.process_group)
            fp.copy_out(kind.pieces(0, kind.numel, 0), flat)

    # -- backward: bucketed reduce-scatter ----------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """(``reduce_gradients``) Backward passes inside only accumulate the local
        gradients; the next exchange (a backward outside, or ``step()``) sends their sum."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def _new_round(self) -> None:
        self._waiting = [[len({id(piece.param) for piece in b.pieces}) for b in kind.buckets]
                         for kind in self._kinds]
        self._seen: set[int] = set()
        self._launched = 0
        self._futures: list[Any] = []

    def _drain(self) -> None:
        """Wait for the exchanges under way and forget them (a new round starts)."""
        self._grads_ready = False
        futures = self._futures
        self._futures = []
        for f in futures:
            f.exception()
        self._new_round()

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync or self._closed:
            return
        self._grads_ready = False
        if id(p) in self._seen:        # another backward before step(): exchange again
            self._drain()
        self._seen.add(id(p))
        for k, kind in enumerate(self._kinds):
            for b in kind.buckets_of.get(id(p), ()):
                self._waiting[k][b] -= 1
        while self._launched < len(self._order):
            k, b = self._order[self._launched]
            if self._waiting[k][b] > 0:
                break
            self._launch(k, b)

    def _launch(self, k: int, b: int) -> None:
        """Start the reduce-scatter of bucket ``b`` of kind ``k`` (the next in order)."""
        kind = self._kinds[k]
        bucket = kind.buckets[b]
        buf = torch.empty(bucket.length, dtype=kind.dtype, device=kind.device)
        with torch.no_grad():
            fp.copy_in(bucket.pieces, buf, grads=True)
        at, size = bucket.local_at[self.rank], bucket.sizes[self.rank]
        out = self._grads[k][at:at + size]
        self._futures.append(self._engine.submit(reduce_scatter, buf, ReduceOp.AVG,
                                                 self.process_group, True, out))
        self._launched += 1

    def _reduce_gradients(self) -> None:
        """Every bucket's averaged gradient in this rank's local flats."""
        while self._launched < len(self._order):
            self._launch(*self._order[self._launched])
        futures = self._futures
        self._futures = []
        try:
            for f in futures:
                f.result()
        finally:
            self._new_round()

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
        """Step the local optimizer over this rank's shards with the averaged gradients
        (exchanged now where backward has not, with ``reduce_gradients``; else read from
        the parameters' ``.grad``), then all-gather the updated elements: on return every
        rank holds every parameter's new value. Collective over the group. Returns the
        closure's loss (the closure runs first, once)."""
        self._check_open("step")
        loss = None
        if closure is not None:
            self._grads_ready = False   # the closure computes them anew
            with torch.enable_grad():
                loss = closure()
        self._exchange()
        with torch.no_grad():
            for k in range(len(self._kinds)):
                fp.copy_in(self._local_pieces[k], self._values[k], grads=False)
        for shards, grads in zip(self._mine, self._shard_grads):
            for shard, grad in zip(shards, grads):
                shard.grad = grad
        self._grads_ready = False
        self._sync_to_local()
        self.optim.step()
        self._sync_from_local()
        self._gather_parameters()
        return loss

    @torch.no_grad()
    def _exchange(self) -> None:
        """This step's averaged gradients in the local flats (once: ``clip_grad_norm_``
        and ``step`` share them)."""
        if getattr(self, "_grads_ready", False):
            return
        if self.reduce_gradients:
            self._reduce_gradients()
        else:
            for k in range(len(self._kinds)):
                fp.copy_in(self._local_pieces[k], self._grads[k], grads=True)
        self._grads_ready = True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the averaged gradients so that their global norm (every partitioned
        parameter's elements once, over all ranks' shards) is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` over the averaged ``.grad`` of a replica would.
        Call after backward, before :meth:`step` (with ``reduce_gradients`` the
        parameters' ``.grad`` are local, not averaged: clip here). Returns the norm before
        clipping (float64 tensor, the same on every rank). Collective over the group."""
        self._check_open("clip_grad_norm_")
        self._exchange()
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            local = max((float(g.abs().max()) for g in self._grads if g.numel()),
                        default=0.0)
            total = torch.tensor([local], dtype=torch.float64)
            self._engine.submit(allreduce, total, ReduceOp.MAX, self.process_group).result()
            total = total[0]
        else:
            local = sum(float(torch.linalg.vector_norm(g.double(), norm_type) ** norm_type)
                        for g in self._grads if g.numel())
            total = torch.tensor([local], dtype=torch.float64)
            self._engine.submit(allreduce, total, ReduceOp.SUM, self.process_group).result()
            total = total[0] ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in self._grads:
            g.mul_(coef.to(g.dtype))
        return total

    @torch.no_grad()
    def _gather_parameters(self) -> None:
        """Each rank's updated local flat to every rank: one ``allgather`` per kind (per
        segment of at most :data:`GATHER_CAP_BYTES` received), all started at once and
        unpacked into the parameters as they arrive; ranks whose local flat is shorter
        pad it (by one element at most). One message, not one per bucket: at 4 ranks on
        2 cores, 3.5 MiB all-gathered in one message took 2.6 ms, in four 5.6 ms
        (polling waits, development machine). ``allgather_v`` is avoided: MPICH 5.0's
        ``MPI_Allgatherv`` took 158 ms where ``MPI_Allgather`` took 3.6 ms for 1.8 MB per
        rank at 2 ranks, raw mpi4py."""
        n = self.world_size
        if n == 1:
            for k, kind in enumerate(self._kinds):
                fp.copy_out(self._local_pieces[k], self._values[k])
            return
        started = []
        for k, kind in enumerate(self._kinds):
            for lo, width, unpack in self._segments[k]:
                send = self._values[k][lo:lo + width]
                if send.numel() < width:
                    send = torch.cat([send, send.new_zeros(width - send.numel())])
                recv = torch.empty(n, width, dtype=kind.dtype, device=kind.device)
                started.append((unpack, recv, self._engine.submit(
                    allgather, send, self.process_group, True, recv)))
        for unpack, recv, future in started:
            future.result()
            for r in range(n):
                fp.copy_out(unpack[r], recv[r])

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state tensors this rank holds (its shard)."""
        return sum(v.numel() * v.element_size() for s in self.optim.state.values()
                   for v in s.values() if isinstance(v, torch.Tensor))

    def __repr__(self) -> str:
        return (f"ZeroRedundancyOptimizer({self._optimizer_class.__name__}, rank {self.rank} "
                f"of {self.world_size}, owns {self.shard_numel[self.rank]} elements"
                f"{', reduce_gradients' if self.reduce_gradients else ''})")
