"""``hvd.DistributedOptimizer``: Horovod's optimizer wrapper, exchanging gradients in
commlib's buckets while backward runs.

As in Horovod, the result is an instance of a new subclass of the wrapped optimizer's class
(``isinstance(opt, torch.optim.SGD)`` holds) over the same ``param_groups``, with
``synchronize()``, ``skip_synchronize()``, ``set_backward_passes_per_step()`` and
``_parameter_names``. A hook after each parameter's gradient accumulation counts down
``backward_passes_per_step``; at zero the gradient moves into its bucket (a flat buffer the
``.grad`` then views into, :mod:`commlib.algorithms.buckets`) and a bucket whose gradients
are all in is exchanged on commlib's communication thread (:mod:`commlib.ddp.engine`),
buckets strictly in index order on every rank, so no negotiation is needed and
communication overlaps the rest of backward. ``synchronize()`` (called by ``step()``
unless inside ``skip_synchronize()``) gives a zero gradient to every parameter that got
none (as Horovod does), launches the remaining buckets in order and waits.

Arithmetic is Horovod's: ``op=Average`` multiplies by ``1/gradient_predivide_factor``
before the sum and by ``gradient_predivide_factor/size`` after it; ``Compression.fp16``
sends float16. ``algorithm="bytegrad"`` (or ``"gradient_allreduce"``, or an instance of
either) hands each bucket to that commlib algorithm instead (its keyword arguments
follow as ``**algorithm_kwargs``); algorithms that need the DDP wrapper's lifecycle
(model averaging, decentralized, K-FAC, QAdam) are refused with ``ValueError``.
``op=Adasum`` on more than one rank wraps the optimizer in Horovod's delta optimizer
(:mod:`commlib.horovod.optimizer_adasum`).

Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) are
exchanged as Horovod exchanges them, and the wrapped optimizer receives a sparse gradient
either way (``torch.optim.SparseAdam`` accepts nothing else). Once the parameter's
``backward_passes_per_step`` countdown reaches zero, its (accumulated, uncoalesced) sparse
gradient goes through :func:`commlib.horovod.sparse_allreduce_async` under the parameter's
name (an allgather of the indices and of the values, negotiated by name; ``Average``
divides the values by the set size; ``gradient_predivide_factor`` does not apply, as in
Horovod), and ``synchronize()`` puts the gathered, uncoalesced entries of every rank, in
rank order, into the parameter's sparse ``.grad`` in place (``grad.zero_().add_(...)``);
the parameter keeps its (zero) slot in its dense bucket. With ``sparse_as_dense=True`` the
gradient is densified (``to_dense()``) at the end of the countdown and reduced in its
bucket like any dense gradient; ``synchronize()`` then hands back ``result.to_sparse()``
(coalesced, one entry per nonzero element) in the sparse ``.grad``, again as Horovod does.
"""
from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from ..algorithms import registry
from ..algorithms.base import Algorithm, Context
from ..algorithms.buckets import Bucket, build
from ..core import runtime
from ..ddp.engine import Engine
from ..primitives import allgather, allreduce, new_group
from . import state
from .compression import Compression
from .execute import WIRE, Adasum, Average, scale_
from .names import named_parameters as _named
from .process_sets import ProcessSet, global_process_set
from .requests import HorovodInternalError

BUCKET_BYTES = 25 << 20
# Hooks an algorithm may override and still fit the optimizer-wrapper shape.
_WRAPPER_HOOKS = ("before_forward", "after_backward", "before_optimizer_step",
                  "after_optimizer_step", "after_iteration", "need_reset", "reset",
                  "parameters_averaging", "tensors", "make_buckets")


def split_list(items: list, n: int) -> list:
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def _bind(p: torch.Tensor, view: torch.Tensor) -> None:
    grad = p.grad
    if grad is None:
        view.zero_()
        p.grad = view
    elif grad.data_ptr() != view.data_ptr():
        view.copy_(grad)
        p.grad = view


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params: Any, named_parameters: Any, compression: Any,
                 backward_passes_per_step: int = 1, op: int = Average,
                 gradient_predivide_factor: float = 1.0, groups: Any = None,
                 sparse_as_dense: bool = False, process_set: ProcessSet = global_process_set,
                 algorithm: Any = None) -> None:
        super(self.__class__, self).__init__(params)
        self._compression = compression
        named = _named(self.param_groups, named_parameters)
        self._parameter_names = {v: k for k, v in sorted(named, key=lambda kv: kv[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: backward_passes_per_step for _, v in named}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        if groups is not None:
            if not (isinstance(groups, list) or groups > 0):
                raise ValueError("groups should be a non-negative integer or a list of list "
                                 "of torch.Tensor.")
            if isinstance(groups, list):
                seen: set = set()
                for grp in groups:
                    for p in grp:
                        if not isinstance(p, torch.Tensor):
                            raise ValueError("groups must consist of torch.Tensor.")
                        if id(p) in seen:
                            raise ValueError("A parameter can only appear once in groups.")
                        seen.add(id(p))
        self._groups = groups
        self._synchronized = False
        self._should_synchronize = True
        self._hvd_buckets: list = []
        self._hvd_slots: dict = {}
        self._hvd_ready: set = set()
        self._hvd_next = 0
        self._hvd_futures: list = []
        self._hvd_hooks: list = []
        self._hvd_engine = None
        self._hvd_algorithm = algorithm
        self._hvd_sparse: dict = {}   # parameter -> (sparse_allreduce_async's handle, grad)
        self._hvd_densified: dict = {}   # parameter -> its sparse grad (sparse_as_dense)
        st = state.require("DistributedOptimizer")
        if process_set.included() and (st.size > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"):
            self._hvd_setup(st)
        state.optimizers.add(self)

    def _hvd_rebuild(self) -> None:
        """hvd.elastic.run's reset: forget the failed world's buckets, hooks and exchange
        (gradients are dropped: they may view buffers MPI can still write) and set them up
        over the new world."""
        if self.process_set is not global_process_set:
            raise HorovodInternalError("commlib.horovod.elastic: a DistributedOptimizer on a "
                                       "process set cannot go on after a reset (only the "
                                       "global set is rebuilt)")
        for h in self._hvd_hooks:
            h.remove()
        engine, self._hvd_engine = self._hvd_engine, None
        if engine is not None:
            try:
                engine.close(timeout=0.5)
            except Exception:  # noqa: BLE001 - its exchanges failed
                pass
        self._hvd_hooks, self._hvd_buckets, self._hvd_slots = [], [], {}
        self._hvd_sparse, self._hvd_densified, self._hvd_futures = {}, {}, []
        self._hvd_ready, self._hvd_next = set(), 0
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._synchronized = False
        st = state.require("DistributedOptimizer")
        if st.size > 1 or os.environ.get("HOROVOD_ELASTIC") == "1":
            self._hvd_setup(st)

    # -- setup --------------------------------------------------------------------------
    def _hvd_setup(self, st: Any) -> None:
        ctrl = st.controllers[self.process_set.process_set_id]
        self._hvd_group = new_group(parent=ctrl.data)   # its own message space
        self._hvd_size = self._hvd_group.size
        plist = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        names = [self._parameter_names.get(p) for p in plist]
        sig = repr([(n, tuple(p.shape), str(p.dtype)) for n, p in zip(names, plist)])
        digest = np.frombuffer(hashlib.sha256(sig.encode()).digest()[:16], dtype=np.int64)
        table = allgather(digest.copy(), group=self._hvd_group)
        if not (table == table[0]).all():
            bad = [r for r in range(len(table)) if not (table[r] == table[0]).all()]
            raise ValueError(f"commlib.horovod.DistributedOptimizer (rank {st.rank}): the "
                             f"parameters (names, shapes, dtypes) differ between ranks: "
                             f"process-set ranks {bad} differ from rank 0")
        named = list(zip(names, plist))
        if self._groups is None:
            self._hvd_buckets = build(named, BUCKET_BYTES)
        else:
            if isinstance(self._groups, list):
                ids = {id(p) for p in plist}
                pgroups = [[p for p in grp if id(p) in ids] for grp in self._groups]
                grouped = {id(p) for grp in pgroups for p in grp}
                pgroups += [[p] for p in plist if id(p) not in grouped]
            else:
                pgroups = split_list(plist, self._groups)
            index = {id(p): i for i, p in enumerate(plist)}
            chunks = []
            for grp in reversed([g for g in pgroups if g]):
                by_kind: dict = {}
                for p in sorted(grp, key=lambda q: index[id(q)]):
                    by_kind.setdefault((p.dtype, p.device), []).append(p)
                chunks += list(by_kind.values())
            self._hvd_buckets = [Bucket(k, [self._parameter_names[p] for p in c], c)
                                 for k, c in enumerate(chunks)]
        for b in self._hvd_buckets:
            for i, p in enumerate(b.tensors):
                self._hvd_slots[p] = (b, i)
        self._hvd_engine = Engine(runtime.thread_multiple(), "commlib-horovod-optimizer")
        alg = self._hvd_algorithm
        if alg is not None:
            self._hvd_ctx = Context(module=torch.nn.Module(), group=self._hvd_group,
                                    named_parameters=named, bucket_cap_bytes=BUCKET_BYTES,
                                    submit=self._hvd_engine.submit, buckets=self._hvd_buckets)
            alg.attach(self._hvd_ctx)
            alg.setup(self._hvd_ctx)
        self._hvd_hooks = [p.register_post_accumulate_grad_hook(self._make_hook(p))
                           for p in plist]
        self._hvd_reset()

    def _hvd_reset(self) -> None:
        self._hvd_ready = set()
        self._hvd_next = 0
        self._hvd_futures = []
        for b in self._hvd_buckets:
            b.pending = len(b)

    # -- during backward ----------------------------------------------------------------
    def _make_hook(self, p: torch.Tensor) -> Any:
        def hook(param: torch.Tensor) -> None:
            if p in self._hvd_ready:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate "
                    "gradients locally.")
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                grad = p.grad
                if grad is not None and grad.is_sparse and not self.sparse_as_dense:
                    self._hvd_sparse_launch(p)
                else:
                    if grad is not None and grad.is_sparse:   # sparse_as_dense
                        self._hvd_densified[p] = grad
                        p.grad = grad.to_dense()
                    self._hvd_mark_ready(p)
                self._hvd_launch()
        return hook

    def _hvd_mark_ready(self, p: torch.Tensor) -> None:
        bucket, i = self._hvd_slots[p]
        _bind(p, bucket.views[i])
        self._hvd_ready.add(p)
        bucket.pending -= 1

    def _hvd_sparse_launch(self, p: torch.Tensor) -> None:
        """Start Horovod's sparse exchange of ``p.grad``; ``p``'s dense slot is left
        out (zeros) of its bucket."""
        from .ops import sparse_allreduce_async
        bucket, _ = self._hvd_slots[p]
        self._hvd_ready.add(p)
        bucket.pending -= 1
        grad = p.grad
        name = "sparse." + str(self._parameter_names.get(p))
        self._hvd_sparse[p] = (sparse_allreduce_async(grad, name=name, op=self.op,
                                                      process_set=self.process_set), grad)

    def _hvd_launch(self) -> None:
        buckets = self._hvd_buckets
        while self._hvd_next < len(buckets) and buckets[self._hvd_next].pending == 0:
            b = buckets[self._hvd_next]
            self._hvd_futures.append(self._hvd_engine.submit(self._hvd_exchange, b))
            self._hvd_next += 1

    def _hvd_exchange(self, bucket: Bucket) -> Any:
        """Communication thread: reduce ``bucket.flat`` in place, Horovod's arithmetic."""
        with torch.no_grad():
            return self._hvd_reduce(bucket)

    def _hvd_reduce(self, bucket: Bucket) -> Any:
        alg = self._hvd_algorithm
        if alg is not None:
            return alg.on_bucket_ready(self._hvd_ctx, bucket)
        flat = bucket.flat
        data, cctx = self._compression.compress(flat)
        if self.op == Average:
            f = self.gradient_predivide_factor
            scale_(data, 1.0 / f)
            allreduce(data, op=WIRE[self.op], group=self._hvd_group)
            scale_(data, f / self._hvd_size)
        else:
            allreduce(data, op=WIRE[self.op], group=self._hvd_group)
        if data is not flat:
            flat.copy_(self._compression.decompress(data, cctx))
        return None

    # -- Horovod's API ------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every gradient exchange of this step (parameters without a gradient get
        zeros, as Horovod); gradients are then averaged on every rank."""
        if not self.process_set.included():
            self._synchronized = True
            return
        if self._hvd_engine is not None:
            for b in self._hvd_buckets:
                for p in b.tensors:
                    if p not in self._hvd_ready:
                        self._hvd_mark_ready(p)
            self._hvd_launch()
            futures, self._hvd_futures = self._hvd_futures, []
            sparse, self._hvd_sparse = self._hvd_sparse, {}
            densified, self._hvd_densified = self._hvd_densified, {}
            try:
                for f in futures:
                    f.result()
                # Horovod: the sparse gradient receives the result in place.
                for p, (handle, grad) in sparse.items():
                    p.grad = grad.zero_().add_(handle())
                for p, grad in densified.items():
                    p.grad = grad.zero_().add_(p.grad.to_sparse())
            finally:
                for p in self._allreduce_delay:
                    self._allreduce_delay[p] = self.backward_passes_per_step
                self._hvd_reset()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``optimizer.synchronize(); ...; with optimizer.skip_synchronize():
        optimizer.step()`` - step without synchronizing again."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def _hvd_base_step(self) -> Any:
        """The wrapped class's step, nothing exchanged (broadcast_optimizer_state)."""
        return super(self.__class__, self).step()

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        if self._hvd_ready or self._hvd_futures:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(*args, **kwargs)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def load_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super(self.__class__, self).load_state_dict(*args, **kwargs)


def _resolve_algorithm(algorithm: Any, kwargs: dict) -> Algorithm | None:
    if algorithm is None:
        if kwargs:
            raise TypeError(f"DistributedOptimizer got unexpected keyword arguments "
                            f"{sorted(kwargs)} (algorithm keyword arguments need algorithm=)")
        return None
    alg = registry.get(algorithm, **kwargs) if isinstance(algorithm, str) else algorithm
    if not isinstance(alg, Algorithm):
        raise TypeError(f"DistributedOptimizer: argument 'algorithm' must be a commlib "
                        f"algorithm name or instance, got {type(algorithm).__name__}")
    cls = type(alg)
    extra = [h for h in _WRAPPER_HOOKS if getattr(cls, h) is not getattr(Algorithm, h)]
    if extra or cls.on_bucket_ready is Algorithm.on_bucket_ready or cls.exchanges != "gradients":
        raise ValueError(f"DistributedOptimizer: algorithm {alg.name!r} needs the "
                         f"DistributedDataParallel wrapper (it overrides {extra or 'none of'} "
                         f"the per-bucket exchange); algorithms that fit an optimizer wrapper "
                         f"exchange gradient buckets only: gradient_allreduce, bytegrad")
    return alg


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set, *,
                         algorithm: Any = None, **algorithm_kwargs: Any) -> Any:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged (``op``) over
    ``process_set``; see the module docstring. Every rank of the set constructs it
    (collective: a group and a check that all ranks hold the same parameters)."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    alg = _resolve_algorithm(algorithm, algorithm_kwargs)
    if alg is not None and (op != Average or compression is not Compression.none
                            or gradient_predivide_factor != 1.0):
        raise ValueError(f"DistributedOptimizer: algorithm={alg.name!r} does its own averaging "
                         f"and compression; leave op, compression and "
                         f"gradient_predivide_factor at their defaults")
    st = state.require("DistributedOptimizer")
    if op == Adasum and st.size > 1:
        if process_set is not global_process_set:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        from .optimizer_adasum import _DistributedAdasumOptimizer
        cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
                   dict(_DistributedAdasumOptimizer.__dict__))
        return cls(optimizer.param_groups, named_parameters, compression,
                   backward_passes_per_step)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               op, gradient_predivide_factor, groups, sparse_as_dense, process_set, alg)
