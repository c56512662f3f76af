"""``commlib.DistributedDataParallel``: the drop-in replacement of torch's DDP."""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch

from .. import runtime
from ..algorithms import registry
from ..algorithms.base import GRADIENTS, Algorithm, Context
from ..algorithms.buckets import MB
from ..primitives import allreduce, broadcast, new_group
from ..reduce_ops import ReduceOp
from .consistency import check_same_model
from .engine import Engine
from .graph import reached_parameters
from .hooks import GradientHooks


class DistributedDataParallel(torch.nn.Module):
    """Data-parallel training over MPI with a pluggable communication algorithm.

    Behaves like ``torch.nn.parallel.DistributedDataParallel``: wrap the model, train as
    usual, launch with ``mpiexec -n N``. At construction (collective over ``group``, default
    the world) every rank must wrap a model with the same parameter and buffer names,
    shapes and dtypes (else :class:`commlib.CommError` naming the first difference), and
    parameters and buffers are broadcast from rank 0. Buffers are broadcast again before
    each forward when ``broadcast_buffers``. During backward, gradients are grouped into
    buckets of about ``bucket_cap_mb`` MiB (reverse registration order, the first bucket
    small) and each bucket is exchanged by ``algorithm`` as soon as its last gradient is
    ready, on a communication thread, overlapping with the rest of backward; ``backward()``
    returns once every exchange finished and ``.grad`` holds the result on every rank.

    ``algorithm`` is a registered name (see ``commlib.algorithms.available()``) configured by
    ``algorithm_kwargs``, or an :class:`commlib.algorithms.Algorithm` instance. With
    ``find_unused_parameters=True``, parameters the forward pass did not reach do not stall
    their bucket; parameters unused on every rank keep ``grad`` as it was (``None``).
    Optimizer steps of any ``torch.optim`` optimizer over the module's parameters are
    observed through optimizer hooks, so algorithms that act around the step need nothing
    more from the training loop.
    """

    def __init__(self, module: torch.nn.Module, algorithm: str | Algorithm = "gradient_allreduce",
                 bucket_cap_mb: float = 25.0, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, group: Any = None,
                 **algorithm_kwargs: Any) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"DistributedDataParallel: argument 'module' must be a "
                            f"torch.nn.Module, got {type(module).__name__}")
        if bucket_cap_mb <= 0:
            raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be positive, "
                             f"got {bucket_cap_mb}")
        self.module = module
        self.find_unused_parameters = bool(find_unused_parameters)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.algorithm = _make_algorithm(algorithm, algorithm_kwargs)
        # A communicator of our own: the wrapper's collectives never match the user's.
        self.process_group = new_group(parent=group)
        check_same_model(module, self.process_group)
        threaded = runtime.thread_multiple()
        if not threaded:
            warnings.warn("commlib: MPI lacks MPI_THREAD_MULTIPLE; gradient exchange will not "
                          "overlap with backward", RuntimeWarning, stacklevel=2)
        self._engine = Engine(threaded)
        self._sync = True
        self._broadcast(list(module.parameters()) + list(module.buffers()))
        self._ctx = Context(module=module, group=self.process_group,
                            named_parameters=list(module.named_parameters()),
                            bucket_cap_bytes=int(bucket_cap_mb * MB),
                            submit=self._engine.submit)
        self.algorithm.setup(self._ctx)
        self._hooks = GradientHooks(self._ctx, self.algorithm, self._engine,
                                    self.find_unused_parameters)
        self._rebuild_buckets()
        self._optimizer_hooks = _register_optimizer_hooks(self)

    # -- torch DDP surface -------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ctx, algo = self._ctx, self.algorithm
        if algo.need_reset(ctx):
            algo.reset(ctx)
            self._rebuild_buckets()
        if self.broadcast_buffers:
            self._broadcast(list(self.module.buffers()))
        algo.before_forward(ctx)
        output = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            reached = reached_parameters(output) if self.find_unused_parameters else None
            self._hooks.expect_backward(reached, exchange=self._sync)
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients of backward passes inside accumulate locally; the first backward after
        the block exchanges the accumulated sum."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def average_parameters(self) -> None:
        """Collective: replace every parameter by its average over the group (e.g. to make
        decentralized or local-SGD replicas equal before evaluation or saving)."""
        with self.algorithm.parameters_averaging(self._ctx):
            self._average_parameters()

    def _average_parameters(self) -> None:
        params = [p for p in self.module.parameters()]
        if not params or self.process_group.size == 1:
            return
        with torch.no_grad():
            for ts in _by_dtype(params).values():
                flat = torch.cat([t.detach().reshape(-1) for t in ts])
                self._ctx_run(allreduce, flat, ReduceOp.AVG, self.process_group)
                _scatter(flat, ts)

    def close(self) -> None:
        """Stop the algorithm and the communication thread; remove every hook."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for handle in self._optimizer_hooks:
            handle.remove()
        self._hooks.remove()
        self.algorithm.teardown(self._ctx)
        self._engine.close()
        self.process_group.free()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- internals -----------------------------------------------------------------------
    def _rebuild_buckets(self) -> None:
        self._ctx.buckets = self.algorithm.make_buckets(self._ctx)
        self._hooks.attach(self._ctx.buckets, self.algorithm.exchanges == GRADIENTS)

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Coalesced broadcast from rank 0, one flat buffer per dtype and device."""
        if not tensors or self.process_group.size == 1:
            return
        with torch.no_grad():
            for ts in _by_dtype(tensors).values():
                flat = torch.cat([t.detach().reshape(-1) for t in ts])
                self._ctx_run(broadcast, flat, 0, self.process_group)
                _scatter(flat, ts)

    def _ctx_run(self, fn: Any, *args: Any) -> Any:
        return self._engine.submit(fn, *args).result()

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, before: bool) -> None:
        if before:
            self.algorithm.before_optimizer_step(self._ctx, optimizer)
        else:
            self._ctx.step += 1
            self.algorithm.after_optimizer_step(self._ctx, optimizer)


def _by_dtype(tensors: list[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


def _scatter(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def _make_algorithm(algorithm: Any, kwargs: dict[str, Any]) -> Algorithm:
    if isinstance(algorithm, str):
        return registry.get(algorithm, **kwargs)
    if isinstance(algorithm, Algorithm):
        if kwargs:
            raise TypeError(f"DistributedDataParallel: keyword arguments {sorted(kwargs)} "
                            f"configure an algorithm given by name; {algorithm!r} is already "
                            f"configured")
        return algorithm
    raise TypeError(f"DistributedDataParallel: argument 'algorithm' must be a registered name "
                    f"or an Algorithm instance, got {type(algorithm).__name__}")


def _register_optimizer_hooks(ddp: DistributedDataParallel) -> list[Any]:
    """Global optimizer hooks, filtered to optimizers that hold the module's parameters."""
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)
    import weakref
    ref = weakref.ref(ddp)
    mine = {id(p) for p in ddp.module.parameters()}

    def owns(optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in mine for g in optimizer.param_groups for p in g["params"])

    def pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        target = ref()
        if target is not None and not getattr(target, "_closed", False) and owns(optimizer):
            target._optimizer_step(optimizer, before=True)

    def post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        target = ref()
        if target is not None and not getattr(target, "_closed", False) and owns(optimizer):
            target._optimizer_step(optimizer, before=False)

    return [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
