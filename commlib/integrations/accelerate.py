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
  collective of Accelerate. (``InitProcessGroupKwargs(backend="commlib")`` is refused by
  Accelerate's own backend check, which only knows its built-in backends.)

``accelerator.unwrap_model()`` and ``accelerator.save_model()`` see through commlib's
wrapper: Accelerate unwraps instances of ``torch.nn.parallel.DistributedDataParallel``
(``accelerate.utils.extract_model_from_parallel``), which commlib's wrapper is a subclass
of, so saved keys carry no ``module.`` prefix. With a relaxed algorithm, call
``model.average_parameters()`` on every rank before saving (the runner's epoch-end sync
points do it for loops over a ``DistributedSampler``; Accelerate's prepared loaders shard
with their own samplers, so under Accelerate call it yourself).

**Distributed on CPU without ``cpu=True``.** Accelerate chooses multi-process CPU training
(``DistributedType.MULTI_CPU``) only when ``cpu=True`` or ``ACCELERATE_USE_CPU`` is true
(``accelerate launch --cpu`` sets it) and ``WORLD_SIZE``/``PMI_SIZE``/``OMPI_COMM_WORLD_SIZE``
says more than one process; without it a CPU-only machine runs each process alone
(``DistributedType.NO``). :func:`prepare_environment` sets ``ACCELERATE_USE_CPU=true`` when
this process is one of several and torch has no accelerator (never on a GPU machine, never
over a value the user set); commlib calls it when ``accelerate`` is imported after commlib
(or at ``import commlib`` if it already was) and the runner calls it at start.
"""
from __future__ import annotations

import os
import sys
from typing import Any, MutableMapping

WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


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
