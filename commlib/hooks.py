"""torch-style DDP communication hooks that need nothing but commlib, for
:meth:`commlib.DistributedDataParallel.register_comm_hook` (``hook(state, bucket) ->
torch.futures.Future``; ``state`` is a :class:`commlib.Group` or ``None``, the wrapper's
group). Same names and semantics as ``torch.distributed.algorithms.ddp_comm_hooks.
default_hooks``::

    ddp.register_comm_hook(None, commlib.hooks.fp16_compress_hook)
    ddp.register_comm_hook(None, commlib.hooks.bf16_compress_wrapper(my_hook))

For a precision choice without a hook (and with a predivide factor), pass
``comm_dtype=``/``predivide_factor=`` to :class:`commlib.DistributedDataParallel`.
"""
from .ddp.comm_hooks import (GradBucket, allreduce_hook, bf16_compress_hook,
                             bf16_compress_wrapper, fp16_compress_hook, fp16_compress_wrapper)

__all__ = ["GradBucket", "allreduce_hook", "bf16_compress_hook", "bf16_compress_wrapper",
           "fp16_compress_hook", "fp16_compress_wrapper"]
