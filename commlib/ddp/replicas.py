"""Relaxed replicas: when a wrapper's replicas may differ, averaging them only then, and
the warning when one rank's replica is read as if it were the model.

A relaxed algorithm (one that exchanges weights: ``local_sgd``, ``decentralized``,
``low_precision_decentralized``, ``async_model_average`` after its warm-up, ``diloco``)
lets the replicas drift apart between its synchronizations. A wrapper counts its replicas
as apart once an iteration ended since it was built or since the last
:meth:`~commlib.DistributedDataParallel.average_parameters` (every rank counts the same
iterations, so every rank reaches the same verdict and it may decide a collective).

Saving one rank's replica then saves one model of several. Where every rank is known to be
present (the runner's sync points, Lightning's checkpoints, Accelerate's ``save_model`` and
``save_state``) commlib averages first (:func:`average_if_apart`); where only one rank may
be there (``ddp.state_dict()``, ``ddp.module.state_dict()``, anything that reads the
module's state dict) it cannot, and a :class:`RelaxedReplicaWarning` names
``average_parameters()``, once per wrapper. Code that saves its own replica on purpose
(a per-rank checkpoint with ``ddp.algorithm.state_dict()``, elastic snapshots) does so
under :func:`per_rank_state`, or filters the warning's category.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from ..algorithms.base import WEIGHTS

_quiet = threading.local()
# id(wrapped module) -> its live wrapper (frameworks keep the bare module, e.g. Accelerate's
# prepared models; a wrapper holds its module, so the id is not reused while it lives).
_wrappers: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


class RelaxedReplicaWarning(UserWarning):
    """A state dict of a relaxed algorithm's module was taken while the replicas differ:
    it holds this rank's replica only. Issued once per wrapper, on the rank that took it."""


def is_relaxed(algorithm: Any) -> bool:
    """Whether ``algorithm`` currently lets replicas differ (it exchanges weights)."""
    return getattr(algorithm, "exchanges", None) == WEIGHTS


def average_if_apart(ddp: Any) -> bool:
    """Collective over ``ddp``'s group when its replicas may differ (see
    ``ddp.replicas_may_differ``, the same on every rank), else nothing: average them with
    ``ddp.average_parameters()``. Returns whether it averaged (the same on every rank)."""
    if getattr(ddp, "_closed", True) or not ddp.replicas_may_differ:
        return False
    ddp.average_parameters()
    return True


def wrappers_in(modules: Iterable[Any]) -> list[Any]:
    """The open commlib wrappers that are, or wrap, a module inside ``modules`` (each once,
    in the order of ``module.modules()`` over ``modules``: the same on every rank that
    holds the same models)."""
    found: list[Any] = []
    for module in modules:
        for m in module.modules():
            ddp = _wrappers.get(id(m))
            if ddp is not None and ddp.module is m and not ddp._closed and \
                    all(ddp is not f for f in found):
                found.append(ddp)
    return found


@contextlib.contextmanager
def per_rank_state() -> Iterator[None]:
    """Inside, state dicts of replicas that differ are this rank's on purpose (a per-rank
    checkpoint saved with the algorithm's state, a diagnostic): no
    :class:`RelaxedReplicaWarning` in this thread. Local; nests."""
    _quiet.depth = getattr(_quiet, "depth", 0) + 1
    try:
        yield
    finally:
        _quiet.depth -= 1


def watch_state_dicts(ddp: Any) -> Any:
    """Register on ``ddp.module`` the state-dict pre-hook that warns (once per wrapper)
    when its state dict is taken while the replicas may differ, and ``ddp`` as the module's
    wrapper (:func:`wrappers_in`); returns the hook's handle. Both hold ``ddp`` weakly."""
    ref = weakref.ref(ddp)

    def hook(module: Any, prefix: str, keep_vars: bool) -> None:
        target = ref()
        if target is None or getattr(_quiet, "depth", 0) or target._replica_warned or \
                target._closed or not target.replicas_may_differ:
            return
        target._replica_warned = True
        warnings.warn(message(target), RelaxedReplicaWarning, stacklevel=3)

    _wrappers[id(ddp.module)] = ddp
    return ddp.module.register_state_dict_pre_hook(hook)


def message(ddp: Any) -> str:
    ctx = ddp._ctx
    return (f"commlib (rank {ctx.rank}): a state dict of {type(ddp.module).__name__}, "
            f"wrapped by DistributedDataParallel(algorithm={ddp.algorithm.name!r}), holds "
            f"this rank's replica only: the replicas trained "
            f"{ctx.step - ddp._averaged_step} iteration(s) since their last average and "
            f"differ. To save or evaluate the model, call ddp.average_parameters() on every "
            f"rank first; to save this rank's replica on purpose (with "
            f"ddp.algorithm.state_dict(), for an exact resume), take it under "
            f"commlib.ddp.per_rank_state(). (Warned once per wrapper.)")
