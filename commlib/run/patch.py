"""What the runner changes in torch before the script runs.

* ``torch.nn.parallel.DistributedDataParallel`` (and the same name in
  ``torch.nn.parallel.distributed``, where Lightning imports it from) becomes
  :class:`DistributedDataParallel` below: commlib's wrapper with the runner's algorithm as
  its default. Code that looks the name up after the runner started (the script and every
  framework it imports, ``from torch.nn.parallel import DistributedDataParallel as DDP``
  included) builds commlib's wrapper. ``isinstance``/``issubclass`` against that name hold
  for every DistributedDataParallel, torch's own and commlib's included (so frameworks
  recognize a wrapper whoever built it), and commlib's wrapper is a subclass of torch's
  class, so checks against the original hold too. torch's own class stays available as
  :data:`TORCH_DDP`.
* ``init_process_group()`` without a backend (and
  ``torch.distributed.get_default_backend_for_device``) picks the runner's backend: the
  ``cpu`` and ``cuda`` entries of torch's default device-backend map are set to it. A
  backend the script names explicitly is used as named.
* The sync points (:mod:`commlib.run.sync`): the end of a ``DataLoader`` epoch over a
  ``DistributedSampler``, and ``destroy_process_group()``.
"""
from __future__ import annotations

from typing import Any

from ..ddp import DistributedDataParallel as _CommlibDDP
from . import sync
from .config import Config

TORCH_DDP: Any = None  # torch's own DistributedDataParallel, once installed
_config = Config()
_TORCH_CLASS = _CommlibDDP.__bases__[0]  # torch's, whatever the name points to now


class _AnyDistributedDataParallel(type(_CommlibDDP)):  # type: ignore[misc]
    """The runner's class stands for torch's name: instances of every
    DistributedDataParallel (torch's, commlib's, the runner's) are instances of it."""

    # By the MRO: ABCMeta's own check would ask torch's class's subclasses, this one included.
    def __instancecheck__(cls, obj: Any) -> bool:
        return _TORCH_CLASS in type(obj).__mro__ or \
            _TORCH_CLASS in getattr(getattr(obj, "__class__", None), "__mro__", ())

    def __subclasscheck__(cls, sub: Any) -> bool:
        return _TORCH_CLASS in getattr(sub, "__mro__", ())


class DistributedDataParallel(_CommlibDDP, metaclass=_AnyDistributedDataParallel):
    """``commlib.DistributedDataParallel`` whose ``algorithm`` defaults to the runner's
    (``--algorithm``, ``--algorithm-config``) and whose replicas are averaged at the
    runner's sync points. Arguments as torch's ``DistributedDataParallel``; an explicit
    ``algorithm=`` (with its own keyword arguments) overrides the runner's."""

    def __init__(self, module: Any, *args: Any, algorithm: Any = None, **kwargs: Any) -> None:
        if algorithm is None:
            algorithm = _config.algorithm
            kwargs = {**_config.algorithm_config, **kwargs}
        super().__init__(module, *args, algorithm=algorithm, **kwargs)
        sync.track(self)


def install(config: Config) -> None:
    """Apply ``config`` to torch (idempotent; a later call replaces the configuration)."""
    global TORCH_DDP, _config
    import torch.distributed as dist
    import torch.nn.parallel
    import torch.nn.parallel.distributed as distributed

    _config = config
    if TORCH_DDP is None:
        TORCH_DDP = distributed.DistributedDataParallel
    torch.nn.parallel.DistributedDataParallel = DistributedDataParallel
    distributed.DistributedDataParallel = DistributedDataParallel
    if dist.is_available():
        if config.backend == "commlib":
            from ..torch_backend.registration import register
            register()
        for device in ("cpu", "cuda"):
            dist.Backend.default_device_backend_map[device] = config.backend
    sync.configure(config.sync_points, config.verbose)
    sync.install_dataloader_hook()
    sync.install_destroy_hook()
