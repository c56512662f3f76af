"""Hand-off of :class:`commlib.elastic.State` to ranks that lack it: a broadcast from one
member (survivors a step behind, replacements), point to point tensor by tensor
(:mod:`commlib.elastic.transfer`: joining spares), and a received state taken as this
rank's own."""
from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

from ..ddp.replicas import per_rank_state
from ..primitives import broadcast
from . import transfer
from .policies import REPLICATED

#: Tag of the point-to-point state transfers (:meth:`State._transfer`).
TRANSFER_TAG = 34


class _Handoff:
    """:class:`~commlib.elastic.State`'s hand-off (a mixin)."""

    def _receive(self, group: Any, root: int, optimizer: bool = True, keep: bool = False,
                 adopted: bool = False) -> None:
        """Collective over ``group``: everyone takes the state of member ``root`` (its
        optimizer's too, unless ``optimizer`` is false: each keeps its own), but members
        that pass ``keep`` (they hold the state already: they only take part in the
        broadcast). ``adopted``: the receivers take another rank's state as their own
        (newcomers; see :meth:`_apply`)."""
        data = self._pack() if group.rank == root else None
        takes = group.rank != root and not keep
        if takes:
            self.__dict__["_clean"] = False  # until the state arrived
        size = np.array([0 if data is None else data.size], dtype=np.int64)
        broadcast(size, root, group)
        if data is None:
            data = np.empty(int(size[0]), dtype=np.uint8)
        broadcast(data, root, group)
        if takes:
            self._unpack(data, optimizer, adopted)

    def _transfer(self, group: Any, senders: dict[int, int]) -> None:
        """Over ``group``, point to point: each member ``j`` of ``senders`` takes the
        state of member ``senders[j]`` (every sender holds the same state: the agreed
        commit), tensor by tensor (:mod:`commlib.elastic.transfer`); the other members
        only send, or do nothing. What a joining spare needs, without the survivors
        receiving what they hold."""
        me = group.rank
        mine = [j for j, src in sorted(senders.items()) if src == me]
        if mine:
            tree = self._tree()
            for j in mine:
                transfer.send(group, j, tree, TRANSFER_TAG)
        if me in senders:
            self.__dict__["_clean"] = False  # until the state arrived
            self._apply(transfer.recv(group, senders[me], TRANSFER_TAG), True, adopted=True)

    def _tree(self) -> dict:
        """This rank's state: step, values, model, optimizer, algorithm."""
        with per_rank_state():  # this rank's replica, on purpose
            model_state = self.model.state_dict()
        return {"step": self.step, "values": self.values, "target_size": self.target_size,
                "model": model_state,
                "optimizer": (self.optimizer.state_dict()
                              if self.optimizer is not None else None),
                "algorithm": getattr(self, "_algorithm_state", None)}

    def _pack(self) -> np.ndarray:
        """This rank's state (:meth:`_tree`), serialized."""
        buffer = io.BytesIO()
        torch.save(self._tree(), buffer)
        return np.frombuffer(buffer.getbuffer(), dtype=np.uint8)  # (holds the buffer)

    def _unpack(self, data: np.ndarray, optimizer: bool, adopted: bool = False) -> None:
        """Take the state of :meth:`_pack` (``optimizer`` false: keep this rank's own)."""
        self._apply(torch.load(io.BytesIO(data.tobytes()), weights_only=False), optimizer,
                    adopted)

    def _apply(self, saved: dict, optimizer: bool, adopted: bool = False) -> None:
        """Take the state ``saved`` (of :meth:`_tree`; ``optimizer`` false: keep this
        rank's own). ``adopted``: this rank had no state and takes another rank's as its
        own (a joining spare, a spawned replacement): what the algorithm keeps of that
        rank alone (error feedback) is reset when the state is next wrapped
        (:meth:`~commlib.algorithms.Algorithm.reset_own_state`)."""
        d = self.__dict__
        if adopted:
            d["_adopted"] = True
        with torch.no_grad():
            self.model.load_state_dict(saved["model"])
        if self.optimizer is not None and optimizer:
            self.optimizer.load_state_dict(saved["optimizer"])
        d["step"], d["values"] = saved["step"], saved["values"]
        d["target_size"] = saved["target_size"]
        d["_algorithm_state"] = saved["algorithm"]
        d["_empty"] = False
        self._record(full=self.policy != REPLICATED or self.commit_every > 1)
