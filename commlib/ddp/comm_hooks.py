"""torch DDP communication hooks on commlib's wrapper.

:meth:`DistributedDataParallel.register_comm_hook` takes torch's hook signature,
``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``; ``bucket`` is a
:class:`GradBucket` with the methods of ``torch.distributed.GradBucket``. torch's own hooks
(``torch.distributed.algorithms.ddp_comm_hooks``) work when ``torch.distributed`` is
initialized (e.g. with the ``commlib`` backend); the hooks below need nothing but commlib:
``state`` is a :class:`commlib.Group` or ``None`` (the wrapper's group). Same names and
semantics as ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``; also
importable as ``commlib.hooks``::

    # run: mpiexec -n 2
    import torch
    import commlib

    ddp = commlib.DistributedDataParallel(torch.nn.Linear(8, 2))
    ddp.register_comm_hook(None, commlib.hooks.fp16_compress_hook)
    ddp(torch.randn(4, 8)).sum().backward()        # gradients averaged in float16

    def my_hook(state, bucket):                    # torch's hook signature
        return commlib.hooks.allreduce_hook(state, bucket)

    other = commlib.DistributedDataParallel(torch.nn.Linear(8, 2))
    other.register_comm_hook(None, commlib.hooks.bf16_compress_wrapper(my_hook))
    other(torch.randn(4, 8)).sum().backward()      # my_hook's exchange in bfloat16

For a precision choice without a hook (and with a predivide factor), pass
``comm_dtype=``/``predivide_factor=`` to :class:`commlib.DistributedDataParallel`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..algorithms.base import Algorithm, Context
from ..algorithms.buckets import Bucket
from ..base.reduce_ops import ReduceOp
from ..primitives import allreduce

__all__ = ["GradBucket", "allreduce_hook", "bf16_compress_hook", "bf16_compress_wrapper",
           "fp16_compress_hook", "fp16_compress_wrapper"]


class GradBucket:
    """One bucket of gradients as torch's ``GradBucket`` presents it to a hook.

    ``buffer()`` is the flat 1-D tensor of the bucket's gradients (one dtype and device),
    not divided by the world size; ``gradients()``/``parameters()`` list the per-parameter
    views and parameters in bucket order; ``is_last()`` is true for the last bucket
    exchanged in a backward pass; ``set_buffer(t)`` replaces the tensor ``buffer()``
    returns (as torch's: e.g. a float16 copy that a wrapped hook then exchanges); the
    bucket's gradients take the value of the hook's future in any case."""

    def __init__(self, bucket: Bucket, last: bool, group: Any) -> None:
        self._bucket, self._last, self.group = bucket, last, group
        self._buffer: torch.Tensor = bucket.flat

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return list(self._bucket.views)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.tensors)

    def is_last(self) -> bool:
        return self._last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.shape != self._bucket.flat.shape:
            raise ValueError(f"GradBucket.set_buffer: argument 'tensor' must be a tensor of "
                             f"shape {tuple(self._bucket.flat.shape)} (the bucket), got "
                             f"{getattr(tensor, 'shape', type(tensor).__name__)}")
        self._buffer = tensor


class CommHookAlgorithm(Algorithm):
    """The wrapped algorithm with its bucket exchange replaced by a torch-style hook; every
    other hook is the wrapped algorithm's."""

    def __init__(self, state: Any, hook: Callable[..., Any], inner: Algorithm) -> None:
        self.state, self.hook, self.inner = state, hook, inner
        self.name = f"comm_hook:{getattr(hook, '__qualname__', hook)}"

    def __getattribute__(self, name: str) -> Any:
        if name in _DELEGATED:
            return getattr(object.__getattribute__(self, "inner"), name)
        return object.__getattribute__(self, name)

    def on_bucket_ready(self, ctx: Context, bucket: Bucket) -> None:
        grad_bucket = GradBucket(bucket, bucket.index == len(ctx.buckets) - 1, ctx.group)
        future = self.hook(self.state, grad_bucket)
        if not callable(getattr(future, "wait", None)):
            raise TypeError(f"communication hook {self.name}: must return a "
                            f"torch.futures.Future, got {type(future).__name__}")
        value = future.wait()
        if isinstance(value, (list, tuple)):
            value = value[0]
        if not isinstance(value, torch.Tensor) or value.shape != bucket.flat.shape:
            raise ValueError(f"communication hook {self.name}: the future must hold one "
                             f"tensor of shape {tuple(bucket.flat.shape)} (the bucket), got "
                             f"{getattr(value, 'shape', type(value).__name__)}")
        if value.data_ptr() != bucket.flat.data_ptr() or value.dtype != bucket.flat.dtype:
            bucket.flat.copy_(value)


_DELEGATED = frozenset({"setup", "tensors", "make_buckets", "before_forward", "after_backward",
                        "before_optimizer_step", "after_optimizer_step", "after_iteration",
                        "need_reset", "reset", "teardown", "exchanges", "state_dict",
                        "load_state_dict"})


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future


def allreduce_hook(state: Any, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket over ``state`` (a commlib Group, or ``None``: the wrapper's
    group), like torch's ``default_hooks.allreduce_hook``."""
    group = state if state is not None else bucket.group
    return _done(allreduce(bucket.buffer(), ReduceOp.AVG, group))


def _compress_hook(dtype: torch.dtype) -> Callable[[Any, GradBucket], torch.futures.Future]:
    def hook(state: Any, bucket: GradBucket) -> torch.futures.Future:
        group = state if state is not None else bucket.group
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(group.size)
        allreduce(compressed, ReduceOp.SUM, group)
        return _done(buffer.copy_(compressed))
    return hook


fp16_compress_hook = _compress_hook(torch.float16)
fp16_compress_hook.__doc__ = """Divide by the group size, cast to float16, sum, cast back (torch's
``default_hooks.fp16_compress_hook``): half the bytes of the exchange."""
fp16_compress_hook.__qualname__ = fp16_compress_hook.__name__ = "fp16_compress_hook"
bf16_compress_hook = _compress_hook(torch.bfloat16)
bf16_compress_hook.__doc__ = """As :func:`fp16_compress_hook`, in bfloat16."""
bf16_compress_hook.__qualname__ = bf16_compress_hook.__name__ = "bf16_compress_hook"


def _compress_wrapper(dtype: torch.dtype, name: str) -> Callable[..., Any]:
    def wrapper(hook: Callable[[Any, GradBucket], torch.futures.Future]
                ) -> Callable[[Any, GradBucket], torch.futures.Future]:
        def compressed_hook(state: Any, bucket: GradBucket) -> torch.futures.Future:
            bucket.set_buffer(bucket.buffer().to(dtype))
            future = hook(state, bucket)

            def decompress(done: torch.futures.Future) -> torch.Tensor:
                value = done.value()
                value = value[0] if isinstance(value, (list, tuple)) else value
                out = bucket._bucket.flat
                return out.copy_(value)
            return future.then(decompress)
        compressed_hook.__qualname__ = compressed_hook.__name__ = (
            f"{name}({getattr(hook, '__qualname__', hook)})")
        return compressed_hook
    wrapper.__qualname__ = wrapper.__name__ = name
    wrapper.__doc__ = f"""Wrap a communication hook so that it exchanges the bucket in
    {dtype}: the bucket's buffer is cast to {dtype} (``set_buffer``) before ``hook`` runs,
    and the hook's result is cast back into the bucket's gradients (torch's
    ``default_hooks.{name}``; ``{name}(allreduce_hook)`` averages like the compress hook,
    dividing after the sum)."""
    return wrapper


fp16_compress_wrapper = _compress_wrapper(torch.float16, "fp16_compress_wrapper")
bf16_compress_wrapper = _compress_wrapper(torch.bfloat16, "bf16_compress_wrapper")
