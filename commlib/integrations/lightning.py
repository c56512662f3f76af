"""PyTorch Lightning on commlib: the ``"commlib"`` strategy.

::

    import lightning as L
    import commlib                      # registers strategy="commlib" (imports no Lightning)
    trainer = L.Trainer(accelerator="cpu", strategy="commlib", max_epochs=3)
    # or, with an algorithm and its arguments (and any commlib DDP argument):
    from commlib.integrations.lightning import CommlibStrategy
    trainer = L.Trainer(strategy=CommlibStrategy(algorithm="local_sgd", sync_every=4))

Launch with ``mpiexec -n N python train.py`` (or ``torchrun``). :class:`CommlibStrategy` is
Lightning's ``DDPStrategy`` with the model wrapped in :class:`commlib.DistributedDataParallel`
(algorithm: the ``algorithm`` argument, else ``COMMLIB_ALGORITHM``/``--algorithm`` of
``python -m commlib``, else ``gradient_allreduce``) and torch.distributed over the
``commlib`` backend (``process_group_backend``, e.g. ``"gloo"``, to change it). The ranks
are the launcher's: under ``mpiexec`` every MPI process is one rank whatever ``devices``
says (one CPU device, or the GPU of its local rank), and the ``DistributedSampler`` Lightning
adds shards the data over all of them.

Relaxed algorithms (``local_sgd``, ``decentralized``, ...) leave replicas apart between
their synchronizations; the strategy averages them (every rank, collectively) before every
checkpoint is taken (``lightning_module_state_dict``, called on every rank by
``Trainer.save_checkpoint`` and ``ModelCheckpoint``), at the start of every validation run
and at the end of ``fit`` (the strategy's ``on_train_end``, after the callbacks' and the
module's own ``on_train_end``), each time only if they trained since their last average
(``replicas_may_differ``). A state dict of the module taken anywhere else while they
differ (``model.state_dict()`` on one rank) is that rank's replica: it warns once
(:class:`commlib.ddp.RelaxedReplicaWarning`, see :mod:`commlib.ddp.replicas`). Manual
optimization works (the exchange happens in ``manual_backward``; no reducer is involved).

torch's own DDP over MPI needs no strategy of ours: ``DDPStrategy(process_group_backend=
"commlib")``.
"""
from __future__ import annotations

import importlib
import json
import os
from typing import Any

STRATEGY_NAME = "commlib"
_classes: dict[str, type] = {}


def strategy_class(package: str = "lightning.pytorch") -> type:
    """:class:`CommlibStrategy` for ``package`` (``"lightning.pytorch"`` or
    ``"pytorch_lightning"``, which have distinct class hierarchies)."""
    if package not in _classes:
        _classes[package] = _build(importlib.import_module(package))
    return _classes[package]


def register_lightning() -> None:
    _register("lightning.pytorch")


def register_pytorch_lightning() -> None:
    _register("pytorch_lightning")


def _register(package: str) -> None:
    registry = importlib.import_module(f"{package}.strategies").StrategyRegistry
    if STRATEGY_NAME not in registry:
        strategy_class(package).register_strategies(registry)


def _runner_algorithm() -> tuple[str, dict[str, Any]]:
    """The algorithm ``python -m commlib`` (or ``COMMLIB_ALGORITHM``) asks for."""
    name = os.environ.get("COMMLIB_ALGORITHM") or "gradient_allreduce"
    config = json.loads(os.environ.get("COMMLIB_ALGORITHM_CONFIG") or "{}")
    return name, config


def _build(pl: Any) -> type:
    import torch
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    from ..ddp import DistributedDataParallel
    from ..run import sync
    strategies = importlib.import_module(f"{pl.__name__}.strategies")
    strategy_module = importlib.import_module(f"{pl.__name__}.strategies.strategy")
    rank_zero_only = importlib.import_module(f"{pl.__name__}.utilities.rank_zero").rank_zero_only
    DDPStrategy = strategies.DDPStrategy

    class CommlibStrategy(DDPStrategy):
        """Lightning's ``DDPStrategy`` on :class:`commlib.DistributedDataParallel`.

        ``algorithm``: a registered name or an ``Algorithm`` (``None``: the runner's or
        ``COMMLIB_ALGORITHM``'s, else ``gradient_allreduce``); other keyword arguments are
        commlib ``DistributedDataParallel``'s (torch DDP's, e.g.
        ``find_unused_parameters``, and the algorithm's, e.g. ``sync_every``).
        ``process_group_backend``: torch.distributed's backend for Lightning's own
        collectives (``self.log(sync_dist=True)``, barriers), default ``"commlib"``.
        """

        strategy_name = STRATEGY_NAME

        def __init__(self, algorithm: Any = None, *, accelerator: Any = None,
                     parallel_devices: Any = None, cluster_environment: Any = None,
                     checkpoint_io: Any = None, precision_plugin: Any = None,
                     process_group_backend: str | None = "commlib", timeout: Any = None,
                     **ddp_kwargs: Any) -> None:
            if algorithm is None:
                algorithm, config = _runner_algorithm()
                ddp_kwargs = {**config, **ddp_kwargs}
            extra = {} if timeout is None else {"timeout": timeout}
            super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                             cluster_environment=cluster_environment,
                             checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
                             process_group_backend=process_group_backend, **extra,
                             **ddp_kwargs)
            self.algorithm = algorithm
            # Lightning's DDP redirection toggles torch DDP's reducer flags; ours needs none.
            self._forward_redirection = strategy_module._ForwardRedirection()

        @property
        def root_device(self) -> torch.device:
            devices = self.parallel_devices
            if devices and devices[0].type == "cpu":
                return devices[0]
            return super().root_device

        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            # The launcher's ranks (mpiexec, torchrun), not devices x num_nodes.
            return {"num_replicas": self.world_size, "rank": self.global_rank}

        def set_world_ranks(self) -> None:
            env = self.cluster_environment
            if env is not None and not env.creates_processes_externally:
                super().set_world_ranks()
                return
            rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

        def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
            return DistributedDataParallel(model, device_ids=self.determine_ddp_device_ids(),
                                           algorithm=self.algorithm, **self._ddp_kwargs)

        def _register_ddp_hooks(self) -> None:  # torch DDP's comm hooks: not used here
            pass

        def pre_backward(self, closure_loss: torch.Tensor) -> None:
            pass

        def post_backward(self, closure_loss: torch.Tensor) -> None:
            pass

        def average_parameters(self) -> bool:
            """Collective (every rank): average relaxed replicas now, if they trained since
            their last average (``replicas_may_differ``, the same on every rank). Returns
            whether it averaged."""
            model = self.model
            if isinstance(model, DistributedDataParallel) and not model._closed:
                return sync.average(model)
            return False

        def lightning_module_state_dict(self) -> dict[str, Any]:
            self.average_parameters()
            return super().lightning_module_state_dict()

        def on_validation_start(self) -> None:
            self.average_parameters()
            super().on_validation_start()

        def on_train_end(self) -> None:
            self.average_parameters()
            super().on_train_end()

        def teardown(self) -> None:
            model = self.model
            super().teardown()
            if isinstance(model, DistributedDataParallel):
                model.close()

        @classmethod
        def register_strategies(cls, strategy_registry: Any) -> None:
            strategy_registry.register(
                STRATEGY_NAME, cls,
                description="commlib's DistributedDataParallel over MPI (any algorithm)")

    CommlibStrategy.__module__ = __name__
    CommlibStrategy.__qualname__ = "CommlibStrategy"
    return CommlibStrategy


def __getattr__(name: str) -> Any:
    if name == "CommlibStrategy":
        return strategy_class("lightning.pytorch")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
