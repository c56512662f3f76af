"""Sync points: where every rank averages relaxed replicas without the script's help.

Relaxed algorithms (those that exchange weights: ``local_sgd``, ``decentralized``,
``low_precision_decentralized``, ``async_model_average``) let replicas drift apart between
their synchronizations, so a script written for torch's DDP, which saves or evaluates rank
0's replica assuming every rank holds the same one, would save one replica of several. The
runner averages them (:meth:`commlib.DistributedDataParallel.average_parameters`) at points
that every rank passes at the same step of the same program:

* **epoch end**: a ``DataLoader`` iterator over a ``DistributedSampler`` raises
  ``StopIteration``. Every rank's sampler yields the same number of samples (it pads or
  drops), so every rank's loop ends after the same number of batches: after its last
  optimizer step and before whatever the script does at the end of the epoch (the
  snapshot of a torchrun-style script, evaluation).
* **end of training**: ``torch.distributed.destroy_process_group()`` of the default group
  (what torchrun-style scripts call on every rank when training is over, so code after it
  sees one model), and the script's end (it returned, or exited with status 0). The ranks
  first agree that every one of them got there cleanly and holds the same wrappers (one
  small allreduce); after a non-zero exit nothing is averaged (an exception aborts the
  job as usual).

A wrapper is averaged only if it trained since its last average, whoever made it (a sync
point, a framework's save, the script's own ``average_parameters()``; see
``replicas_may_differ``): an evaluation loader's end costs nothing. Gradient-exchanging
algorithms keep replicas identical: they are never averaged. What a script must still do
itself: average (``model.average_parameters()`` on every rank) before saving or evaluating
at any other point (a state dict of replicas that differ warns once, naming it), e.g.
every N steps inside an epoch, after a loop that is not over a ``DistributedSampler`` (an
``IterableDataset``, an early ``break``), or when only some ranks evaluate mid-epoch.
Optimizer states (momenta) are not averaged, and an unmodified script's snapshot carries
no algorithm state, so a resumed run restarts the algorithm's schedule (correct, not
bit-identical to an uninterrupted run).
"""
from __future__ import annotations

import hashlib
import sys
import weakref
from typing import Any

_tracked: list[weakref.ref] = []
_state = {"enabled": True, "verbose": False, "count": 0, "installed": False, "ever": False}


def configure(enabled: bool, verbose: bool) -> None:
    _state["enabled"], _state["verbose"] = bool(enabled), bool(verbose)


def track(ddp: Any) -> None:
    """Average ``ddp`` (a :class:`commlib.DistributedDataParallel`) at the sync points."""
    _tracked.append(weakref.ref(ddp))
    _state["ever"] = True


def enabled() -> bool:
    """Whether relaxed replicas are averaged automatically (``--no-sync-points``,
    ``COMMLIB_SYNC_POINTS=0`` under the runner turn it off): at the sync points and before
    a framework saves (:mod:`commlib.integrations`)."""
    return _state["enabled"]


def live() -> list[Any]:
    """The tracked wrappers still open, in construction order (the same on every rank)."""
    out = []
    for ref in _tracked:
        ddp = ref()
        if ddp is not None and not getattr(ddp, "_closed", True):
            out.append(ddp)
    return out


def is_relaxed(ddp: Any) -> bool:
    """Whether ``ddp``'s algorithm currently lets replicas differ (it exchanges weights)."""
    from ..ddp.replicas import is_relaxed as relaxed
    return relaxed(ddp.algorithm)


def average(ddp: Any) -> bool:
    """Collective over ``ddp``'s group: average its replicas if its algorithm is relaxed
    and it trained since the last average (``ddp.replicas_may_differ``, whoever averaged:
    a sync point, a framework's save or the script's own ``average_parameters()``).
    Returns whether it averaged."""
    from ..ddp.replicas import average_if_apart
    return average_if_apart(ddp)


def sync_point(reason: str, wrappers: list[Any] | None = None) -> None:
    """Average every live tracked wrapper that needs it (collective over their groups);
    with ``verbose``, report each rank's replica checksums on stderr."""
    wrappers = live() if wrappers is None else wrappers
    averaged = [average(d) for d in wrappers] if _state["enabled"] else [False] * len(wrappers)
    _state["count"] += 1
    if _state["verbose"] and wrappers:
        from ..core import runtime
        parts = [f"{type(d.module).__name__}[{d.algorithm.name}]"
                 f"{' averaged' if a else ''} sha256={checksum(d.module)}"
                 for d, a in zip(wrappers, averaged)]
        state = "" if _state["enabled"] else " (sync points off)"
        print(f"commlib.run: rank {runtime.world().rank}: sync point {_state['count']} "
              f"({reason}){state}: {'; '.join(parts)}", file=sys.stderr, flush=True)


def end_of_training(clean: bool, reason: str = "end of training",
                    leaving: bool = False) -> None:
    """The end-of-training sync point: if every rank got here cleanly and they hold the same
    wrappers, average (collective over every rank that ever tracked a wrapper).

    A rank that got here uncleanly (a non-zero exit) runs no collective at all: the others
    may still be training, and the exit agreement (:mod:`commlib.core.exits`) ends the job within
    ``COMMLIB_EXIT_WINDOW``; a rank waiting here for it is ended the same way. ``leaving``
    (the runner's end of script): first tell the other ranks that this one is leaving, so
    that a rank still training, whose next collective this one will never join, ends the
    job after ``COMMLIB_EXIT_WINDOW`` instead of waiting for ``COMMLIB_TIMEOUT``."""
    if not _state["ever"] or not clean:
        return
    if leaving:
        from ..core import exits
        exits.announce_exit()
    import numpy as np

    from ..base.reduce_ops import ReduceOp
    from ..primitives import allreduce
    wrappers = live()
    agreed = np.array([len(wrappers), -len(wrappers)], dtype=np.int64)
    allreduce(agreed, ReduceOp.MIN)
    if agreed[0] == -agreed[1]:
        sync_point(reason, wrappers)


def checksum(module: Any) -> str:
    """SHA-256 (first 16 hex digits) of ``module.state_dict()``'s names and bytes: what a
    snapshot of the module holds."""
    import torch

    from ..ddp.replicas import per_rank_state
    digest = hashlib.sha256()
    with per_rank_state():  # each rank's own replica, on purpose
        state = module.state_dict()
    for name, tensor in state.items():
        digest.update(name.encode())
        flat = tensor.detach().cpu().contiguous().view(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def install_destroy_hook() -> None:
    """Make ``destroy_process_group()`` of the default group an end-of-training sync point
    (idempotent)."""
    if _state.get("destroy"):
        return
    import torch.distributed as dist
    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d
    original = distributed_c10d.destroy_process_group

    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is dist.group.WORLD:
            end_of_training(True, "end of training: destroy_process_group")
        return original(group)

    destroy_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    destroy_process_group.__doc__ = original.__doc__
    dist.destroy_process_group = distributed_c10d.destroy_process_group = destroy_process_group
    _state["destroy"] = True


def install_dataloader_hook() -> None:
    """Make the end of every ``DataLoader`` epoch over a ``DistributedSampler`` a sync point
    (idempotent)."""
    if _state["installed"]:
        return
    from torch.utils.data import dataloader
    from torch.utils.data.distributed import DistributedSampler
    base = dataloader._BaseDataLoaderIter
    original = base.__next__

    def __next__(self: Any) -> Any:
        try:
            return original(self)
        except StopIteration:
            sampler = getattr(self, "_index_sampler", None)
            sampler = getattr(sampler, "sampler", sampler)  # a BatchSampler's sampler
            epoch = getattr(self, "_sampler_iter", None)
            if isinstance(sampler, DistributedSampler) and \
                    getattr(self, "_commlib_synced", None) is not epoch:
                self._commlib_synced = epoch  # once per epoch, however often next() is called
                sync_point("epoch end")
            raise

    __next__.__wrapped__ = original  # type: ignore[attr-defined]
    base.__next__ = __next__
    _state["installed"] = True
