"""torch DDP's constructor arguments: validation, and what each one means here.

| argument | handling |
|---|---|
| ``device_ids`` | ``None``/``[]`` for CPU and multi-device modules, else exactly one CUDA device holding the whole module (``ValueError`` otherwise, as torch); inputs are moved there before ``forward``, as torch does |
| ``output_device`` | validated as torch does (``None`` for CPU modules); defaults to ``device_ids[0]`` |
| ``dim`` | accepted (torch only uses it to scatter over several devices per process) |
| ``broadcast_buffers`` / ``forward_sync_buffers`` | torch 2.13's rules: buffers broadcast from rank 0 before each forward; ``broadcast_buffers=False`` also skips them at construction |
| ``init_sync`` | ``False`` skips the model check and the initial broadcast |
| ``process_group`` / ``device_mesh`` | a :class:`commlib.Group`, a torch ``ProcessGroup`` (of any backend: its ranks) or a 1-D ``DeviceMesh``; ``None`` is the world |
| ``bucket_cap_mb`` / ``bucket_cap_mb_list`` | bucket size in MiB (``None``: 25), or one cap per bucket |
| ``find_unused_parameters`` | as torch: parameters the forward output does not reach are ready at once |
| ``static_graph`` / ``_set_static_graph()`` | as torch: the first iteration learns which parameters get no gradient; parameters used outside forward are allowed |
| ``check_reduction`` | deprecated in torch; accepted, no effect |
| ``gradient_as_bucket_view`` | accepted; gradients always view into the buckets (``True``'s behaviour) |
| ``delay_all_reduce_named_params`` / ``param_to_hook_all_reduce`` | validated as torch (both or neither); those parameters are exchanged with the rest (same result) |
| ``skip_all_reduce_unused_params``, ``batched_grad_copy`` | accepted; performance options with no effect on results |
| ``mixed_precision`` | ``ValueError`` unless ``None`` (use ``torch.autocast``) |
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from ..algorithms import registry
from ..algorithms.base import Algorithm
from ..algorithms.buckets import MB

DEFAULT_BUCKET_CAP_MB = 25.0


def ignored_names(module: torch.nn.Module) -> set[str]:
    """Names torch DDP leaves alone (``module._ddp_params_and_buffers_to_ignore``)."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()) or ())


def check_module(module: Any) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"DistributedDataParallel: argument 'module' must be a "
                        f"torch.nn.Module, got {type(module).__name__}")
    ignore = ignored_names(module)
    params = [p for n, p in module.named_parameters() if n not in ignore]
    for p in params:
        if isinstance(p, torch.nn.parameter.UninitializedParameter):
            raise RuntimeError("DistributedDataParallel: modules with uninitialized parameters "
                               "can't be wrapped; run a dummy forward pass first")
    if not any(p.requires_grad for p in params):
        raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have "
                           "any parameter that requires a gradient.")
    types = {p.device.type for p in params}
    if len(types) != 1:
        raise ValueError(f"DistributedDataParallel's input module must be on the same type of "
                         f"devices, but input module parameters locate in {types}.")
    for name, m in module.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and \
                m.weight.requires_grad:
            raise ValueError(
                f"DistributedDataParallel: {name or 'the module'} ({type(m).__name__}) has "
                f"sparse=True, so parameter '{name + '.' if name else ''}weight' gets sparse "
                f"gradients, which commlib does not exchange. Construct it with sparse=False "
                f"(dense gradients; results are the same), or keep it out of the wrapped "
                f"module.")


def devices(module: torch.nn.Module, device_ids: Any, output_device: Any
            ) -> tuple[list[int] | None, int | None]:
    """torch's rules for ``device_ids``/``output_device``; returns the validated pair."""
    if device_ids is not None and not isinstance(device_ids, (list, tuple)):
        raise TypeError(f"DistributedDataParallel: argument 'device_ids' must be None or a list "
                        f"of one device, got {type(device_ids).__name__}"
                        + (" (pass algorithm= by keyword)" if isinstance(device_ids, str)
                           else ""))
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element.")
    params = list(module.parameters())
    multi = len({p.device for p in params}) > 1
    device_type = params[0].device.type if params else "cpu"
    if not device_ids or device_type == "cpu" or multi:
        if device_ids or output_device:
            raise ValueError(
                f"DistributedDataParallel device_ids and output_device arguments only work "
                f"with single-device/multiple-device GPU modules or CPU modules, but got "
                f"device_ids {device_ids}, output_device {output_device}, and module "
                f"parameters {({p.device for p in params})}.")
        return None, None
    ids = [torch.device(d).index if not isinstance(d, int) else d for d in device_ids]
    if any(p.device.index != ids[0] for p in params):
        raise ValueError(f"DistributedDataParallel: device_ids {device_ids} name a device "
                         f"that does not hold the module's parameters "
                         f"({({p.device for p in params})})")
    out = ids[0] if output_device is None else (
        output_device if isinstance(output_device, int) else torch.device(output_device).index)
    return ids, out


def bucket_caps(bucket_cap_mb: Any, bucket_cap_mb_list: Any) -> list[int]:
    """Bucket caps in bytes: one per bucket (the last repeats)."""
    if bucket_cap_mb_list:
        caps = list(bucket_cap_mb_list)
    else:
        caps = [DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb]
    for cap in caps:
        if isinstance(cap, bool) or not isinstance(cap, (int, float)):
            raise TypeError(f"DistributedDataParallel: bucket_cap_mb must be a number or None, "
                            f"got {type(cap).__name__}")
        if not cap > 0:
            raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be positive, "
                             f"got {cap}")
    return [max(1, int(cap * MB)) for cap in caps]


def check_unsupported(mixed_precision: Any, delay_named: Any, hook_param: Any) -> None:
    if mixed_precision is not None:
        raise ValueError("DistributedDataParallel: mixed_precision is not supported by commlib; "
                         "use torch.autocast (and torch.amp.GradScaler) around the forward")
    if (delay_named is None) != (hook_param is None):
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to "
                         "be set at the same time.")


def make_algorithm(algorithm: Any, kwargs: dict[str, Any]) -> Algorithm:
    """An algorithm instance from a registered name and its keyword arguments (unknown
    keywords raise ``TypeError`` naming them), or an instance as is."""
    if isinstance(algorithm, str):
        names = registry.available()
        if algorithm not in names:
            raise ValueError(f"DistributedDataParallel: unknown algorithm {algorithm!r}; "
                             f"available: {', '.join(names)}")
        cls = registry.lookup(algorithm)
        accepted = _keywords(cls)
        unknown = sorted(k for k in kwargs if accepted is not None and k not in accepted)
        if unknown:
            raise TypeError(
                f"DistributedDataParallel got unexpected keyword argument(s) {unknown}: not "
                f"arguments of torch's DistributedDataParallel, and taken for arguments of "
                f"algorithm {algorithm!r}, which accepts {sorted(accepted) or 'none'}")
        return cls(**kwargs)
    if isinstance(algorithm, Algorithm):
        if kwargs:
            raise TypeError(f"DistributedDataParallel: keyword arguments {sorted(kwargs)} are "
                            f"not arguments of torch's DistributedDataParallel; algorithm "
                            f"arguments configure an algorithm given by name, and "
                            f"{algorithm!r} is already configured")
        return algorithm
    raise TypeError(f"DistributedDataParallel: argument 'algorithm' must be a registered name "
                    f"or an Algorithm instance, got {type(algorithm).__name__}")


def _keywords(cls: type) -> set[str] | None:
    """Keyword names ``cls`` accepts (``None``: it takes ``**kwargs``)."""
    params = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.name != "self"
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def resolve_group(process_group: Any, device_mesh: Any) -> Any:
    """The commlib group behind ``process_group``/``device_mesh`` (``None``: the world)."""
    from ..primitives import Group
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        process_group = device_mesh.get_group(mesh_dim=0)
    if process_group is None or isinstance(process_group, Group):
        return process_group
    import torch.distributed as dist
    if isinstance(process_group, dist.ProcessGroup):
        return _from_torch_group(process_group)
    raise TypeError(f"DistributedDataParallel: argument 'process_group' must be None, a "
                    f"commlib.Group or a torch.distributed.ProcessGroup, got "
                    f"{type(process_group).__name__}")


def _from_torch_group(pg: Any) -> Any:
    import torch.distributed as dist

    from ..core import runtime
    try:
        from ..torch_backend import commlib_group
    except ImportError:
        commlib_group = None
    if commlib_group is not None:
        group = commlib_group(pg)
        if group is not None:
            return group
    ranks = list(dist.get_process_group_ranks(pg))
    world = runtime.world()
    if dist.get_rank() != world.rank:
        raise ValueError(f"DistributedDataParallel: torch.distributed rank {dist.get_rank()} is "
                         f"not MPI rank {world.rank}; launch with mpiexec so both agree")
    if ranks == list(world.world_ranks):
        return None
    from ..primitives import group_from_ranks
    group = group_from_ranks(ranks)  # members only, as torch builds the wrapper there only
    group.temporary = True  # the wrapper frees it once it has its own copy
    return group
