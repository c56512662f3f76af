"""Hugging Face Accelerate on commlib.

Recipes (launch with ``mpiexec -n N`` or ``torchrun``):

* **no edit**: ``mpiexec -n 2 python -m commlib [--algorithm NAME] train.py``. Accelerate's
  ``prepare(model)`` builds ``torch.nn.parallel.DistributedDataParallel``, which under the
  runner is commlib's wrapper with the runner's algorithm; Accelerate's own collectives
  (``gather``, ``reduce``, ``wait_for_everyone``) use the process group it creates (gloo
  on CPU, the backend it names).
* **one edit**: ``torch.distributed.init_process_group("commlib")`` before
  ``Accelerator()``: Accelerate takes that process group, so ``prepare(model)`` builds
  torch's ``DistributedDataParallel`` over commlib's MPI collectives, and so does every
  collective of Accelerate. ``accelerator.state.backend`` is then ``"commlib"``, the default
  group's backend (see *The backend Accelerate records*). (``InitProcessGroupKwargs(
  backend="commlib")`` is refused by Accelerate's own backend check, which only knows its
  built-in backends.)

``accelerator.unwrap_model()`` and ``accelerator.save_model()`` see through commlib's
wrapper: Accelerate unwraps instances of ``torch.nn.parallel.DistributedDataParallel``
(``accelerate.utils.extract_model_from_parallel``), which commlib's wrapper is a subclass
of, so saved keys carry no ``module.`` prefix.

**Relaxed algorithms** (``--algorithm local_sgd``, ``decentralized``, ...: the replicas
differ between synchronizations, see :mod:`commlib.ddp.replicas`). Per entry point:

* ``accelerator.save_model(model, ...)`` and ``accelerator.save_state(...)`` average the
  replicas of commlib's wrappers first (of ``model``, wrapped or not; of every prepared
  model), collectively, when they trained since their last average: Accelerate has every
  rank call them (its main process writes; under FSDP and DeepSpeed they are collectives
  already). The file then holds the average of the replicas, and every rank trains on from
  it. ``--no-sync-points`` (``COMMLIB_SYNC_POINTS=0``) turns this off.
* ``accelerator.get_state_dict(model)``, ``unwrap_model(model).state_dict()``,
  ``save_pretrained(...)``, ``model.state_dict()``: no collective (scripts call them on the
  main process only, and a collective there would hang or mismatch): they return this
  rank's replica, and the first one taken while the replicas differ warns
  (``commlib.ddp.RelaxedReplicaWarning``, once per wrapper, naming
  ``model.average_parameters()``). Call ``model.average_parameters()`` on every rank
  before them (the runner's epoch-end sync points do not fire under Accelerate: its
  prepared loaders shard with their own samplers, not a ``DistributedSampler``).

**The backend Accelerate records.** ``PartialState`` chooses its backend from the device
and the environment (``gloo`` for multi-process CPU) before it looks at torch.distributed,
and keeps that name even when it finds the default process group already initialized
(it then skips ``init_process_group``): with the one-edit recipe it would report ``gloo``
while every collective goes to ``commlib``. :func:`install` wraps
``PartialState._prepare_backend`` so that, once the default group is initialized, the
backend it records is that group's (``torch.distributed.get_backend()``); Accelerate
branches on it (``gather`` uses ``all_gather_into_tensor`` for backends other than gloo,
which commlib's backend implements). It applies to states made after commlib is imported
(``init_process_group("commlib")`` imports it).

**Distributed on CPU without ``cpu=True``.** Accelerate chooses multi-process CPU training
(``DistributedType.MULTI_CPU``) only when ``cpu=True`` or ``ACCELERATE_USE_CPU`` is true
(``accelerate launch --cpu`` sets it) and ``WORLD_SIZE``/``PMI_SIZE``/``OMPI_COMM_WORLD_SIZE``
says more than one process; without it a CPU-only machine runs each process alone
(``DistributedType.NO``). :func:`prepare_environment` sets ``ACCELERATE_USE_CPU=true`` when
this process is one of several and torch has no accelerator (never on a GPU machine, never
over a value the user set); commlib calls it (through :func:`install`) when ``accelerate``
is imported after commlib (or at ``import commlib`` if it already was), and the runner
calls it at start (:func:`prepare_with_runner`).
"""
from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, MutableMapping
from typing import Any

WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def install() -> None:
    """What commlib does once ``accelerate`` is imported: :func:`prepare_environment`,
    then :func:`patch`. Idempotent; local to this process."""
    prepare_environment()
    patch()


def prepare_with_runner() -> None:
    """What commlib does once :mod:`commlib.run` is imported: the runner's
    :func:`~commlib.run.install` then calls :func:`prepare_environment` at start, before
    the script imports Accelerate (idempotent)."""
    from .. import run
    if prepare_environment not in run.PREPARE:
        run.PREPARE.append(prepare_environment)


def patch() -> None:
    """Wrap three of Accelerate's methods (idempotent): ``PartialState._prepare_backend``
    records the backend of an already initialized default process group; and
    ``Accelerator.save_model`` and ``Accelerator.save_state`` first average the relaxed
    replicas of commlib's wrappers (:func:`average_before_saving`; collective, as those
    methods are called on every rank). Imports ``accelerate``."""
    from accelerate import accelerator, state
    _wrap(state.PartialState, "_prepare_backend", _recording_backend)
    _wrap(accelerator.Accelerator, "save_model", _averaging_save_model)
    _wrap(accelerator.Accelerator, "save_state", _averaging_save_state)


def default_group_backend(chosen: str | None) -> str | None:
    """The backend Accelerate should record, given the one it ``chose``: the default
    process group's (``torch.distributed.get_backend()``) when one is initialized and
    Accelerate chose a torch.distributed backend, else ``chosen``."""
    if chosen is None or chosen == "xla":
        return chosen
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return chosen
    return str(dist.get_backend())


def average_before_saving(models: list[Any]) -> list[Any]:
    """Collective over every rank of the wrappers' groups: average the replicas of commlib's
    wrappers that are, or wrap, a module inside ``models`` (Accelerate's prepared models are
    the bare modules), in the same order on every rank, if they may differ
    (``replicas_may_differ``). Nothing when ``--no-sync-points``
    (``COMMLIB_SYNC_POINTS=0``). Returns the wrappers it averaged."""
    from ..ddp.replicas import wrappers_in
    from ..run import sync
    if not sync.enabled():
        return []
    return [w for w in wrappers_in(models) if sync.average(w)]


def _wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = cls.__dict__[name]
    if getattr(original, "_commlib", False):
        return
    wrapped = functools.wraps(original)(make(original))
    wrapped._commlib = True  # type: ignore[attr-defined]
    setattr(cls, name, wrapped)


def _recording_backend(original: Callable[..., Any]) -> Callable[..., Any]:
    def _prepare_backend(self: Any, *args: Any, **kwargs: Any) -> Any:
        backend, distributed_type = original(self, *args, **kwargs)
        return default_group_backend(backend), distributed_type
    return _prepare_backend


def _averaging_save_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def save_model(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        average_before_saving([model])
        return original(self, model, *args, **kwargs)
    return save_model


def _averaging_save_state(original: Callable[..., Any]) -> Callable[..., Any]:
    def save_state(self: Any, *args: Any, **kwargs: Any) -> Any:
        average_before_saving(list(self._models))
        return original(self, *args, **kwargs)
    return save_state


def prepare_environment(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``ACCELERATE_USE_CPU=true`` if this process is one of several (the variables
    Accelerate reads) on a machine where torch sees no accelerator, and the user did not
    set it. Returns whether it set it. Imports torch only if it is already imported."""
    env = os.environ if environ is None else environ
    if "ACCELERATE_USE_CPU" in env or world_size(env) <= 1:
        return False
    torch = sys.modules.get("torch")
    if torch is None or has_accelerator(torch):
        return False
    env["ACCELERATE_USE_CPU"] = "true"
    return True


def world_size(environ: Any) -> int:
    """The job's size as Accelerate reads it (the first of its variables that is set)."""
    for name in WORLD_SIZE_VARIABLES:
        value = environ.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                return 1
    return 1


def has_accelerator(torch: Any) -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())
