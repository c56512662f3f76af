"""A background averaging engine: tensors averaged over a group on a thread of its own,
while the caller goes on training.

Rounds run on a dedicated duplicated communicator, so they never match the caller's
collectives. Each round first agrees, with a one-integer allreduce, whether every rank
still wants to go on; a stop asked on any rank therefore ends the engine on every rank
after the same round, and no rank is left waiting in a collective its peers never make.
Needs ``MPI_THREAD_MULTIPLE``.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from .. import runtime
from ..errors import CommError
from ..reduce_ops import ReduceOp
from .allreduce import allreduce
from .group import new_group


class BackgroundAverager:
    """Average tensors in the background, one round every ``interval_s`` seconds.

    ``snapshot()`` (called under ``lock``) returns the local tensor to average (a flat copy
    the engine owns); ``apply(delta)`` (under ``lock``) receives ``average - snapshot`` so
    the caller keeps the local progress it made while the round was in flight. Create it
    on every rank of ``group`` (collective); ``start``/``stop`` may be called repeatedly.
    """

    def __init__(self, snapshot: Callable[[], Any], apply: Callable[[Any], None],
                 interval_s: float, group: Any = None,
                 lock: threading.Lock | None = None) -> None:
        if not runtime.thread_multiple():
            from mpi4py import MPI
            raise CommError(f"commlib.BackgroundAverager (rank {runtime.get_rank()}): needs "
                            f"MPI_THREAD_MULTIPLE, but the MPI library provides thread level "
                            f"{MPI.Query_thread()}; use a thread-multiple MPI build")
        self.group = new_group(parent=group)
        self.interval_s = float(interval_s)
        self.lock = lock or threading.Lock()
        self.rounds = 0
        self._snapshot, self._apply = snapshot, apply
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start averaging (all ranks call it; a no-op if already running)."""
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="commlib-averager",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask every rank's engine to stop after the current round and wait until this
        rank's thread has ended (no thread, no pending request left). Re-raises an error
        the thread met."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Stop (see :meth:`stop`) and release the engine's communicator; call on every rank."""
        self.stop()
        self.group.free()

    def _loop(self) -> None:
        try:
            while self._agree_to_continue():
                self._round()
                self._stop.wait(self.interval_s)
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self._error = exc

    def _agree_to_continue(self) -> bool:
        flag = np.array([0 if self._stop.is_set() else 1], dtype=np.int32)
        allreduce(flag, op=ReduceOp.MIN, group=self.group)
        return bool(flag[0])

    def _round(self) -> None:
        with self.lock:
            local = self._snapshot()
            base = local.clone() if hasattr(local, "clone") else local.copy()
        allreduce(local, op=ReduceOp.AVG, group=self.group)
        local -= base
        with self.lock:
            self._apply(local)
        self.rounds += 1
