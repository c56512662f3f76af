"""``hvd.elastic``: Horovod's elastic training on commlib's fault-tolerant mode.

Horovod's names and semantics (``horovod/common/elastic.py``,
``horovod/torch/elastic/{state,sampler}.py`` of 0.28.1) over commlib's recovery from a dead
rank (:mod:`commlib.fault.fault_tolerance`: launch with ``COMMLIB_FAULT_TOLERANT=1`` and
``mpiexec -disable-auto-cleanup``, one hydra proxy per failure domain)::

    # run: COMMLIB_FAULT_TOLERANT=1 mpiexec -disable-auto-cleanup -n 2
    import torch
    import commlib.horovod as hvd

    hvd.init()
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(list(range(32)))
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, 2):
            indices = list(sampler)
            for state.batch in range(state.batch, len(indices) // 4):
                optimizer.zero_grad()
                model(torch.randn(4, 4)).sum().backward()
                optimizer.step()
                sampler.record_batch(state.batch, 4)
                state.commit()
            state.batch = 0
            sampler.set_epoch(state.epoch + 1)

    train(state)

:func:`run` calls ``state.sync()`` (every rank takes rank 0's state) and the function;
when a peer dies the function sees :class:`HorovodInternalError` or
:class:`commlib.PeerFailure` from whatever collective it was in, on every survivor; ``run``
then calls ``state.restore()`` (this rank's last commit), resets Horovod over the survivors
(the failed controllers are abandoned, not closed; commlib's world shrinks to the
survivors, :meth:`commlib.Group.shrink`; ``hvd.init()`` again; every
``DistributedOptimizer`` rebuilds its buckets and exchange over the new world), calls
``state.on_reset()`` (the ``register_reset_callbacks`` callbacks) and starts again with
``state.sync()``.

Not supported (Horovod needs ``horovodrun --host-discovery-script``): adding ranks (host
discovery, growing back; ``HostsUpdatedInterrupt`` is never raised, :meth:`State.check_host_updates`
does nothing) and ``min_np``/``max_np``; :func:`run` outside fault-tolerant mode raises
``RuntimeError`` (a dead rank would end the job).
"""
from __future__ import annotations

import copy
import functools
import math
import random
from collections.abc import Callable
from typing import Any

import torch

from ..base.errors import PeerFailure
from ..base.options import options
from . import state as _state
from .requests import HorovodInternalError


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's interrupt for added or removed hosts (never raised here: see the module
    docstring)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__()
        self.skip_sync = skip_sync


class State:
    """Horovod's ``State``: ``commit()`` = ``save()`` + ``check_host_updates()``;
    ``restore()``, ``sync()`` and ``save()`` are the subclasses'."""

    def __init__(self, bcast_object: Callable, get_rank: Callable) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list = []

    def register_reset_callbacks(self, callbacks: list) -> None:
        """Functions called (no arguments) after each reset over the survivors."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: Any, update_res: Any) -> None:
        pass

    def commit(self) -> None:
        """Save the state in memory (rank-local) and check for host updates."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Nothing to do: ranks are never added here (see the module docstring)."""

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def reset(self) -> None:
        pass


class ObjectState(State):
    """Horovod's ``ObjectState``: keyword values as attributes; ``save()`` keeps their
    current values (by reference, as Horovod), ``restore()`` sets them back, ``sync()``
    broadcasts rank 0's."""

    def __init__(self, bcast_object: Callable, get_rank: Callable, **kwargs: Any) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod 0.28.1's ``ElasticSampler``: ``dataset``'s indices (a new permutation per
    epoch from ``seed + epoch`` when ``shuffle``, Python's ``random.Random``, the same on
    every rank), less the ``processed_num`` already processed this epoch, padded to a
    multiple of the world size and dealt round-robin (``rank::size``). ``record_batch``
    counts ``batch_size * size`` processed samples; ``set_epoch`` starts an epoch (call it
    at the end of each); ``state_dict``/``load_state_dict`` (``epoch``, ``processed_num``)
    and ``reset()`` (re-deals the remaining indices over the current world; a
    :class:`TorchState` calls it on restore and sync)."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list = []
        self.num_samples = 0
        self.total_size = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record ``batch_size`` samples processed on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def state_dict(self) -> dict:
        return dict(epoch=self.epoch, processed_num=self.processed_num)

    def reset(self) -> None:
        st = _state.require("elastic.ElasticSampler")
        self.num_replicas, self.rank = st.size, st.rank
        all_indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(all_indices)
        self.remaining_indices = all_indices[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Any:
        self.indices = self.remaining_indices[:]
        self.indices += self.indices[:(self.total_size - len(self.indices))]
        self.indices = self.indices[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


# -- TorchState's handlers (Horovod's) ------------------------------------------------------
class _Handler:
    def __init__(self, value: Any) -> None:
        self.value = value
        self._saved = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class _Model(_Handler):
    def sync(self) -> None:
        from .functions import broadcast_parameters
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _Optimizer(_Handler):
    def sync(self) -> None:
        from .functions import broadcast_optimizer_state
        broadcast_optimizer_state(self.value, root_rank=0)


class _Scheduler(_Handler):
    def sync(self) -> None:
        from .functions import broadcast_object
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


class _Sampler(_Handler):
    def sync(self) -> None:
        from .functions import broadcast_object
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


_HANDLERS = [(torch.nn.Module, _Model), (torch.optim.Optimizer, _Optimizer),
             (torch.optim.lr_scheduler.LRScheduler, _Scheduler), (ElasticSampler, _Sampler)]


class TorchState(ObjectState):
    """Horovod's ``TorchState(model=None, optimizer=None, **kwargs)``: models, optimizers,
    learning-rate schedulers and :class:`ElasticSampler` among the values are saved as
    deep copies of their ``state_dict`` (restored with ``load_state_dict``, synced by
    broadcast from rank 0: parameters, optimizer state, the sampler's state); the other
    values as :class:`ObjectState` keeps them. Every value is an attribute
    (``state.epoch``, ``state.batch``)."""

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(dict(model=model, optimizer=optimizer))
        handlers, rest = {}, {}
        for k, v in kwargs.items():
            cls = next((h for t, h in _HANDLERS if isinstance(v, t)), None)
            if cls is not None:
                handlers[k] = cls(v)
            else:
                rest[k] = v
        self._handlers = handlers
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        from .basics import rank
        from .functions import broadcast_object
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **rest)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(self, name) and name in self.__dict__.get("_handlers", {}):
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)


# -- run ----------------------------------------------------------------------------------
def _peer_died(exc: BaseException) -> bool:
    if isinstance(exc, PeerFailure):
        return True
    from ..fault import fault_tolerance
    return bool(fault_tolerance.dead_in_world())


def _reset() -> None:
    """Horovod over the survivors: abandon the failed world, shrink it, init again."""
    from ..primitives import world
    from .basics import abandon, init
    abandon()
    while True:
        try:
            world().shrink()
            break
        except PeerFailure:
            continue   # another death meanwhile: agree again without it
    init()
    _state.rebuild_optimizers()


def run(func: Callable) -> Callable:
    """``@hvd.elastic.run``: call ``func(state, ...)`` until it returns, going on over the
    survivors after a peer failure (see the module docstring). A
    :class:`HorovodInternalError` that is not due to a dead peer (e.g. mismatched
    collectives) is raised as it is."""
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not options.fault_tolerant:
            raise RuntimeError("commlib.horovod.elastic.run needs commlib's fault-tolerant "
                               "mode: launch with COMMLIB_FAULT_TOLERANT=1 (and mpiexec "
                               "-disable-auto-cleanup), else a dead rank ends the job")
        while True:
            try:
                state.sync()
                return func(state, *args, **kwargs)
            except (HorovodInternalError, PeerFailure) as exc:
                if not _peer_died(exc):
                    raise
            for _ in range(100):   # a failure during the reset: once more without it
                try:
                    state.restore()
                    _reset()
                    state.on_reset()
                    break
                except (HorovodInternalError, PeerFailure):
                    continue
    return wrapper
