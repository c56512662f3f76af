"""``commlib.DistributedDataParallel``: the drop-in replacement of torch's DDP."""
from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.algorithms.join import Joinable

from ..algorithms.base import GRADIENTS, Algorithm, Context
from ..algorithms.buckets import plan
from ..base.options import options
from ..base.reduce_ops import ReduceOp
from ..core import runtime
from ..primitives import Group, allreduce, broadcast, new_group
from . import arguments, replicas
from .consistency import check_same_model
from .engine import Engine
from .graph import reached_parameters
from .hooks import FIND_UNUSED, STATIC, STRICT, GradientHooks
from .join import Join, TorchJoinHook, notify_torch_join

# Construction broadcasts and average_parameters() move at most this much at once.
COALESCE_BYTES = 64 << 20


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """Data-parallel training over MPI with a pluggable communication algorithm.

    A subclass of ``torch.nn.parallel.DistributedDataParallel`` (whose ``__init__`` it does
    not run), so that ``isinstance`` checks in user code and frameworks (Accelerate's
    ``unwrap_model``, Lightning's strategies, ``torch.distributed.checkpoint``) treat it as
    torch's wrapper; every method frameworks call on torch's wrapper is provided here
    (torch's private reducer API is not).

    Behaves like ``torch.nn.parallel.DistributedDataParallel`` and takes its arguments in
    its order (see :mod:`commlib.ddp.arguments` for how each is handled): wrap the model,
    train as usual, launch with ``mpiexec -n N``. At construction (collective over the
    group, default the world) every rank must wrap a model with the same parameter and
    buffer names, shapes and dtypes (else :class:`commlib.CommError` naming the first
    difference on every rank), and parameters and buffers are broadcast from rank 0.
    During backward, gradients are grouped into buckets of about ``bucket_cap_mb`` MiB
    (reverse registration order, the first bucket small) that ``.grad`` views into, and
    each bucket is exchanged by ``algorithm`` as soon as its last gradient is ready, on a
    communication thread, overlapping with the rest of backward; ``backward()`` returns once
    every exchange finished and ``.grad`` holds the result on every rank.

    ``algorithm`` (keyword only) is a registered name (``commlib.algorithms.available()``)
    configured by the remaining keyword arguments, or an
    :class:`commlib.algorithms.Algorithm` instance. An iteration ends with each backward
    outside :meth:`no_sync`; algorithm schedules count iterations, so they agree on every
    rank whatever the number of optimizers or skipped (AMP) steps. Optimizer steps of any
    ``torch.optim`` optimizer holding the module's parameters are observed through
    optimizer hooks.
    """

    # commlib's group (torch's wrapper holds a torch ProcessGroup there)
    process_group: Group  # type: ignore[assignment]

    def __init__(self, module: torch.nn.Module, device_ids: Any = None, output_device: Any = None,
                 dim: int = 0, broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group: Any = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params: Any = None, param_to_hook_all_reduce: Any = None,
                 mixed_precision: Any = None, device_mesh: Any = None,
                 skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: list[float] | None = None, batched_grad_copy: bool = False,
                 forward_sync_buffers: bool | None = None, *,
                 algorithm: str | Algorithm = "gradient_allreduce",
                 **algorithm_kwargs: Any) -> None:
        torch.nn.Module.__init__(self)  # not torch DDP's __init__: nothing of it is used
        Joinable.__init__(self)
        self._torch_join_hook: TorchJoinHook | None = None
        arguments.check_module(module)
        self.device_ids, self.output_device = arguments.devices(module, device_ids,
                                                                output_device)
        arguments.check_unsupported(mixed_precision, delay_all_reduce_named_params,
                                    param_to_hook_all_reduce)
        caps = arguments.bucket_caps(bucket_cap_mb, bucket_cap_mb_list)
        self.algorithm = arguments.make_algorithm(algorithm, algorithm_kwargs)
        parent = arguments.resolve_group(process_group, device_mesh)
        self.module = module
        self.dim = dim
        self.find_unused_parameters = bool(find_unused_parameters)
        self.static_graph = bool(static_graph)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        if forward_sync_buffers is not None:
            self.forward_sync_buffers, init_buffers = bool(forward_sync_buffers), True
        else:
            self.forward_sync_buffers = init_buffers = (
                True if broadcast_buffers is None else bool(broadcast_buffers))
        self._ignored = arguments.ignored_names(module)
        self._closed = False
        # A communicator of our own: the wrapper's collectives never match the user's.
        self.process_group = new_group(parent=parent)
        if getattr(parent, "temporary", False):
            parent.free()
        try:
            self._setup(init_sync, init_buffers, caps)
        except BaseException:
            self._closed = True
            self.process_group.free()
            raise

    def _setup(self, init_sync: bool, init_buffers: bool, caps: list[int]) -> None:
        named = [(n, p) for n, p in self.module.named_parameters() if n not in self._ignored]
        if init_sync:
            check_same_model(self.module, self.process_group, self._ignored)
        threaded = runtime.thread_multiple()
        if not threaded:
            warnings.warn("commlib: MPI lacks MPI_THREAD_MULTIPLE; gradient exchange will not "
                          "overlap with backward", RuntimeWarning, stacklevel=3)
        self._engine = Engine(threaded)
        self._sync = True
        self._join: Join | None = None
        self._comm_hook: Any = None
        if init_sync:
            self._broadcast([p for _, p in named] + (self._buffers_to_sync() if init_buffers
                                                     else []))
        self._ctx = Context(module=self.module, group=self.process_group,
                            named_parameters=named,
                            bucket_cap_bytes=caps[0] if len(caps) == 1 else caps,
                            submit=self._engine.submit)
        self.algorithm.attach(self._ctx)
        self.algorithm.setup(self._ctx)
        mode = FIND_UNUSED if self.find_unused_parameters else STRICT
        if self.static_graph:
            mode = STATIC
        # A weak callback: the hooks never keep the wrapper alive (``del ddp`` closes it).
        end_iteration = weakref.WeakMethod(self._end_iteration)

        def end() -> None:
            method = end_iteration()
            if method is not None:
                method()

        self._hooks = GradientHooks(self._ctx, self.algorithm, self._engine, mode, end)
        self._rebuild_buckets()
        self._optimizer_hooks = _register_optimizer_hooks(self)
        self._averaged_step = self._ctx.step  # replicas equal (broadcast) at construction
        self._replica_warned = False
        self._state_dict_hook = replicas.watch_state_dicts(self)

    # -- torch DDP surface -------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        training = torch.is_grad_enabled()
        if training and self._join is not None:
            self._join.notify(self)
        elif training and self._join_config.enable:
            notify_torch_join(self)
        if training:
            self._start_iteration()
        if self.forward_sync_buffers:
            self._broadcast(self._buffers_to_sync())
        if training:
            self.algorithm.before_forward(self._ctx)
        if self.device_ids:
            inputs, kwargs = _to_device(inputs, kwargs, self.device_ids[0])
        output = self.module(*inputs, **kwargs)
        if training:
            reached = (reached_parameters(output)
                       if self.find_unused_parameters and not self.static_graph else None)
            self._hooks.expect_backward(reached, sync=self._sync)
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients of backward passes inside accumulate locally and no iteration ends;
        the first backward after the block exchanges the accumulated sum."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs, with the semantics of torch DDP's ``join()``:
        a rank that ran out of data shadows the collectives of the others' iterations
        (zero gradients), so nothing hangs; once every rank is out, the model of the last
        rank to run out is broadcast to all. ``divide_by_initial_world_size=False`` averages
        gradients over the ranks still training (averaging algorithms);
        ``throw_on_early_termination=True`` makes every rank raise ``RuntimeError`` as soon
        as one runs out. Collective over the group."""
        return Join(self, divide_by_initial_world_size, enable, throw_on_early_termination)

    def join_hook(self, **kwargs: Any) -> TorchJoinHook:
        """For torch's generic ``Join([ddp, ...])`` context manager (``join()`` needs no
        torch.distributed): shadows the others' iterations, then syncs the final model.
        ``divide_by_initial_world_size`` (default ``True``) as in :meth:`join`."""
        self._torch_join_hook = TorchJoinHook(
            self, kwargs.get("divide_by_initial_world_size", True))
        return self._torch_join_hook

    @property
    def join_device(self) -> torch.device:
        device: torch.device = next(self.module.parameters()).device
        return device

    @property
    def join_process_group(self) -> Any:
        """The torch process group torch's ``Join`` counts ranks on: the default one."""
        import torch.distributed as dist
        if not dist.is_initialized():
            raise RuntimeError("torch's Join needs torch.distributed initialized (e.g. "
                               "init_process_group(backend='commlib')); ddp.join() does not")
        return dist.group.WORLD

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """torch's communication hook: ``hook(state, bucket) -> torch.futures.Future``
        replaces the algorithm's exchange of each gradient bucket (``bucket`` has torch's
        ``GradBucket`` methods; its buffer is not pre-divided; the future's value is the new
        bucket content). Call once, before the first backward; the hook runs on the
        communication thread. See :mod:`commlib.ddp.comm_hooks` for ready-made hooks."""
        from .comm_hooks import CommHookAlgorithm
        if not callable(hook):
            raise TypeError(f"register_comm_hook: argument 'hook' must be callable, got "
                            f"{type(hook).__name__}")
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be "
                               "called once.")
        if self._ctx.step > 0 or self._hooks._started:
            raise RuntimeError("register_comm_hook must be called before the first backward")
        if self.algorithm.exchanges != GRADIENTS:
            raise RuntimeError(f"register_comm_hook: algorithm {self.algorithm.name!r} does not "
                               f"exchange gradients; use algorithm='gradient_allreduce'")
        self._comm_hook = (state, hook)
        self.algorithm = CommHookAlgorithm(state, hook, self.algorithm)
        self._hooks.algorithm = self.algorithm

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag: ``False`` inside :meth:`no_sync` (read at ``forward``)."""
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync = bool(value)

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """What torch DDP's logger reports, for the fields that apply here (frameworks
        read it, e.g. Lightning's ``can_set_static_graph`` at teardown)."""
        return {"module_name": type(self.module).__name__, "algorithm": self.algorithm.name,
                "world_size": self.process_group.size, "find_unused_parameters":
                self.find_unused_parameters, "static_graph": self.static_graph,
                "can_set_static_graph": False}

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("commlib.DistributedDataParallel cannot be pickled or copied (it owns "
                        "a communicator and a communication thread); copy or save .module")

    def __setstate__(self, state: dict[str, Any]) -> None:
        raise TypeError("commlib.DistributedDataParallel cannot be unpickled")

    def _set_static_graph(self) -> None:
        """torch's ``_set_static_graph()``: as ``static_graph=True`` at construction."""
        if self._ctx.step > 0:
            raise RuntimeError("_set_static_graph must be called before the first iteration")
        self.static_graph = True
        self._hooks.mode = STATIC

    def prepare_for_backward(self, outputs: Any, sync: bool = True) -> None:
        """Decide at backward time, not at forward time, whether the next backward pass
        exchanges: ``sync=True`` makes it end an iteration and exchange the gradients
        accumulated since the last exchange (as a backward outside :meth:`no_sync`),
        ``sync=False`` makes it accumulate only. ``outputs`` are those of the forward whose
        backward comes next (they tell, with ``find_unused_parameters``, which parameters
        it reaches). For callers that run several forwards before their backwards in an
        order of their own, e.g. a pipeline schedule (torch's reducer has the same
        ``prepare_for_backward``): call it right before each backward. Local; the ranks of
        the group must make the same choices in the same order."""
        reached = (reached_parameters(outputs)
                   if self.find_unused_parameters and not self.static_graph else None)
        self._hooks.expect_backward(reached, sync=bool(sync))

    def average_parameters(self) -> None:
        """Collective: replace every parameter by its average over the group (e.g. to make
        decentralized or local-SGD replicas equal before evaluation or saving). Runs the
        algorithm's pending end-of-iteration work first, so that nothing queued before the
        call changes the parameters afterwards: on return every rank holds the same values
        and :attr:`replicas_may_differ` is ``False`` until the next iteration ends."""
        self._start_iteration(reset=False)
        params = [p for _, p in self._ctx.named_parameters]
        if params and self.process_group.size > 1:
            with self.algorithm.parameters_averaging(self._ctx):
                self._coalesced(params, lambda flat: allreduce(flat, ReduceOp.AVG,
                                                               self.process_group))
        self._averaged_step = self._ctx.step

    @property
    def replicas_may_differ(self) -> bool:
        """Whether the ranks' replicas may differ now: the algorithm is relaxed (it
        exchanges weights: ``local_sgd``, ``decentralized``, ...), the group has more than
        one rank, and an iteration ended since construction or the last
        :meth:`average_parameters`. The same on every rank (every rank counts the same
        iterations), so it may decide a collective; no communication.

        While it holds, a state dict of the module (``ddp.state_dict()``,
        ``ddp.module.state_dict()``) is this rank's replica only: the first one taken warns
        (:class:`commlib.ddp.RelaxedReplicaWarning`, once per wrapper, naming
        :meth:`average_parameters`; see :mod:`commlib.ddp.replicas`). ``state_dict()``
        itself never communicates: only one rank may call it."""
        return (self.process_group.size > 1 and replicas.is_relaxed(self.algorithm)
                and self._ctx.step != self._averaged_step)

    def close(self) -> None:
        """Stop the algorithm and the communication thread; remove every hook; release the
        communicator. Idempotent; collective only in what the algorithm's teardown does."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for handle in self._optimizer_hooks:
            handle.remove()
        self._state_dict_hook.remove()
        self._hooks.remove()
        try:
            self.algorithm.teardown(self._ctx)
        finally:
            self._engine.close()
            self.process_group.free()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- iterations ----------------------------------------------------------------------
    def _end_iteration(self) -> None:
        """Called by the hooks when a backward outside no_sync finished."""
        self._ctx.iteration_pending = True

    def _start_iteration(self, reset: bool = True) -> None:
        """Run the end-of-iteration work of the previous iteration (every rank at the same
        point), then let the algorithm switch phase."""
        ctx, algo = self._ctx, self.algorithm
        if options.check:
            # Every rank must be at the same iteration (schedules key on it).
            comm = self.process_group.comm
            assert comm is not None  # a duplicate of its parent: every rank is a member
            comm.verify("iteration", {"step": ctx.step})
        if ctx.iteration_pending:
            ctx.iteration_pending = False
            algo.after_iteration(ctx)
        if reset and algo.need_reset(ctx):
            algo.reset(ctx)
            self._rebuild_buckets()

    def _shadow_iteration(self, sync: bool) -> None:
        """One iteration of a rank that has no data (under :meth:`join`): the collectives
        of a forward and, if ``sync``, of a backward with zero gradients."""
        self._start_iteration()
        if self.forward_sync_buffers:
            self._broadcast(self._buffers_to_sync())
        self.algorithm.before_forward(self._ctx)
        if sync:
            self._hooks.shadow_backward()

    # -- internals -----------------------------------------------------------------------
    def _rebuild_buckets(self) -> None:
        self._ctx.buckets = self.algorithm.make_buckets(self._ctx)
        self._hooks.attach(self._ctx.buckets, self.algorithm.exchanges == GRADIENTS)

    def _buffers_to_sync(self) -> list[torch.Tensor]:
        return [b for n, b in self.module.named_buffers() if n not in self._ignored]

    def _broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Broadcast from ``src`` (a group rank), coalesced per dtype and device."""
        if tensors and self.process_group.size > 1:
            self._coalesced(tensors, lambda flat: broadcast(flat, src, self.process_group))

    def _coalesced(self, tensors: Sequence[torch.Tensor],
                   op: Callable[[torch.Tensor], Any]) -> None:
        """Apply the in-place collective ``op`` to the tensors, packed into flat buffers of
        one dtype and device and at most :data:`COALESCE_BYTES` each (so the extra memory
        is bounded by one buffer, not the model), on the communication thread."""
        with torch.no_grad():
            for idx in plan([(str(i), t) for i, t in enumerate(tensors)], COALESCE_BYTES,
                            COALESCE_BYTES):
                group = [tensors[i] for i in idx]
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                self._engine.submit(op, flat).result()
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, before: bool) -> None:
        if before:
            self.algorithm.before_optimizer_step(self._ctx, optimizer)
        else:
            self.algorithm.after_optimizer_step(self._ctx, optimizer)


def _to_device(inputs: tuple[Any, ...], kwargs: dict[str, Any],
               device: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Move tensors inside ``inputs``/``kwargs`` to CUDA device ``device`` (torch DDP does
    this for single-device modules given ``device_ids``)."""
    target = torch.device("cuda", device)

    def move(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.to(target, non_blocking=True)
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(move(o) for o in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(move(o) for o in obj)
        if isinstance(obj, dict):
            return {k: move(v) for k, v in obj.items()}
        return obj

    return move(inputs), move(kwargs)


def _register_optimizer_hooks(ddp: DistributedDataParallel) -> list[Any]:
    """Global optimizer hooks, filtered to optimizers that hold the module's parameters."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )
    ref = weakref.ref(ddp)
    mine = {id(p) for p in ddp.module.parameters()}

    def owns(optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in mine for g in optimizer.param_groups for p in g["params"])

    def before(optimizer: torch.optim.Optimizer) -> None:
        target = ref()
        if target is not None and not target._closed:
            target._optimizer_step(optimizer, before=True)

    def closure_of(args: Any, kwargs: Any) -> Any:
        # torch passes step()'s own arguments: (optimizer, closure) or closure=...
        return kwargs.get("closure", args[1] if len(args) > 1 else None)

    def pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        target = ref()
        if target is None or target._closed or not owns(optimizer):
            return None
        closure = closure_of(args, kwargs)
        if closure is None:
            before(optimizer)
            return None
        # optimizer.step(closure) (Lightning, LBFGS): the closure's backward makes this
        # step's gradients inside step(), so the algorithm's before-step work runs once the
        # closure's first call returned (or raised: its collectives must still match the
        # other ranks'), not before it, where it would act on the previous iteration.

        # (the flag is an attribute of the function: post() reads it from the closure that
        # step() was given; mypy knows no attributes of functions, hence the ignores)
        def closure_then_before_step() -> Any:
            try:
                return closure()
            finally:
                if not closure_then_before_step._commlib_before_done:  # type: ignore[attr-defined]
                    closure_then_before_step._commlib_before_done = True  # type: ignore[attr-defined]
                    before(optimizer)

        closure_then_before_step._commlib_before_done = False  # type: ignore[attr-defined]
        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_before_step}
        return (args[0], closure_then_before_step, *args[2:]), kwargs

    def post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        target = ref()
        if target is not None and not target._closed and owns(optimizer):
            closure = closure_of(args, kwargs)
            if getattr(closure, "_commlib_before_done", True) is False:  # never called
                closure._commlib_before_done = True
                before(optimizer)
            target._optimizer_step(optimizer, before=False)

    return [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
