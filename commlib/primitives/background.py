"""A background averaging engine: tensors averaged over a group on a thread of its own,
while the caller goes on training.

Rounds run on a dedicated duplicated communicator, so they never match the caller's
collectives. Each round snapshots the tensors, then agrees, with one allreduce of three
integers, whether every rank still wants to go on and whether every rank's snapshot
belongs to the same *epoch*; a stop asked on any rank therefore ends the engine on every
rank after the same round, and no rank is left waiting in a collective its peers never
make. The caller starts a new epoch (:meth:`BackgroundAverager.new_epoch`) when it changed
the tensors on every rank alike (``average_parameters()``): a round whose snapshots span
two epochs is skipped everywhere, and a round applies its correction only on ranks still
in the epoch of its snapshot, so no correction from before such a change lands after it.
A round whose average is not finite (a NaN or Inf in some rank's tensor) is never
applied: every rank sees the same average, so every rank ends the engine after that round
with a :class:`~commlib.base.errors.NonFiniteError` naming the ranks, raised by :meth:`check`
and :meth:`stop`. When a callback raises on one rank, that rank says so in the next
agreement: the engine ends on every rank (the others raise a
:class:`~commlib.base.errors.CommError` naming it) instead of leaving them waiting for it. The
engine registers with :mod:`commlib.mpi.shutdown`, so a script that
ends without :meth:`stop` stops it before MPI is finalized. Needs ``MPI_THREAD_MULTIPLE``.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..base.errors import CommError, NonFiniteError
from ..base.reduce_ops import ReduceOp
from ..core import runtime
from ..mpi import shutdown
from .allreduce import allreduce
from .finite import all_finite, nonfinite_ranks
from .group import new_group


class BackgroundAverager:
    """Average tensors in the background, one round every ``interval_s`` seconds.

    ``snapshot()`` (called under ``lock``) returns the local tensor to average (a flat copy
    the engine owns); ``apply(delta)`` (under ``lock``) receives ``average - snapshot`` so
    the caller keeps the local progress it made while the round was in flight. Create it
    on every rank of ``group`` (collective); ``start``/``stop`` may be called repeatedly.
    :meth:`hold`/:meth:`release` keep rounds from snapshotting or applying meanwhile
    (e.g. across an optimizer step).
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
        self._held = False
        self._epoch = 0

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
        shutdown.register(self)

    def hold(self) -> None:
        """Take ``lock`` for the caller until :meth:`release`: no round snapshots or
        applies meanwhile. A hold never released (the caller raised in between) is kept,
        not taken twice, and is dropped by the next :meth:`release` or :meth:`stop`."""
        if not self._held:
            self.lock.acquire()
            self._held = True

    def release(self) -> None:
        """End a :meth:`hold` (nothing happens without one)."""
        if self._held:
            self._held = False
            self.lock.release()

    @property
    def epoch(self) -> int:
        return self._epoch

    def new_epoch(self) -> None:
        """Call under ``lock``, on every rank, after changing the tensors on every rank
        alike: corrections of rounds snapshotted before are not applied (see the module
        docstring)."""
        self._epoch += 1

    def check(self) -> None:
        """Raise the error that ended the averaging thread, if any (and forget it)."""
        if self._error is not None and not self.running:
            error, self._error = self._error, None
            raise error

    def stop(self) -> None:
        """Ask every rank's engine to stop after the current round and wait until this
        rank's thread has ended (no thread, no pending request left). Re-raises an error
        the thread met."""
        self.release()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()

    def close(self) -> None:
        """Stop (see :meth:`stop`) and release the engine's communicator; call on every rank."""
        try:
            self.stop()
        finally:
            shutdown.unregister(self)
            self.group.free()

    def stop_at_exit(self, deadline: float) -> bool:
        """:mod:`commlib.mpi.shutdown`: stop as :meth:`stop` does, waiting until ``deadline``
        at most; True once the thread has ended. An error the thread met is printed."""
        self.release()
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                return False
            self._thread = None
        if self._error is not None:
            shutdown._note(f"background averaging had ended with "
                           f"{type(self._error).__name__}: {self._error}")
            self._error = None
        return True

    def __repr__(self) -> str:
        return (f"<commlib.BackgroundAverager {'running' if self.running else 'stopped'}, "
                f"{self.rounds} rounds>")

    def _loop(self) -> None:
        failure: BaseException | None = None  # of this rank's snapshot or apply callback
        try:
            while True:
                local, epoch = None, self._epoch
                if failure is None and not self._stop.is_set():
                    try:
                        with self.lock:
                            local, epoch = self._snapshot(), self._epoch
                    except Exception as exc:  # noqa: BLE001 - told to the peers, then raised
                        failure = exc
                go, same_epoch, failed = self._agree(epoch, failure is not None)
                if failed is not None:
                    raise failure or CommError(
                        f"commlib.BackgroundAverager (rank {self.group.rank}): background "
                        f"averaging failed on group rank {failed}; it stopped on every rank")
                if not go:
                    return
                if same_epoch:
                    failure = self._round(local, epoch)
                if failure is None:
                    self._stop.wait(self.interval_s)
        except BaseException as exc:  # noqa: BLE001 - reported by check() and stop()
            self._error = exc

    def _agree(self, epoch: int, failed: bool) -> tuple[bool, bool, int | None]:
        """Collective: (every rank goes on, every rank's snapshot is of the same epoch, the
        group rank whose callback failed or None). A failure is told to the peers here, so
        that it ends the engine on every rank instead of leaving them waiting."""
        status = -1 - self.group.rank if failed else (0 if self._stop.is_set() else 1)
        flags = np.array([status, epoch, -epoch], dtype=np.int64)
        allreduce(flags, op=ReduceOp.MIN, group=self.group)
        failed_rank = int(-1 - flags[0]) if flags[0] < 0 else None
        return bool(flags[0] == 1), bool(flags[1] == -flags[2]), failed_rank

    def _round(self, local: Any, epoch: int) -> BaseException | None:
        """Average ``local`` and apply the correction; returns what the apply callback
        raised (told to the peers at the next agreement)."""
        base = local.clone() if hasattr(local, "clone") else local.copy()
        allreduce(local, op=ReduceOp.AVG, group=self.group)
        if not all_finite(local):  # the same average everywhere: every rank stops here
            bad = nonfinite_ranks(all_finite(base), self.group)
            raise NonFiniteError(
                f"commlib.BackgroundAverager (rank {self.group.rank}): the average of round "
                f"{self.rounds + 1} is not finite (NaN or Inf in the tensors of group ranks "
                f"{bad or 'none: the sum overflowed'}); it was not applied and background "
                f"averaging stopped on every rank")
        local -= base
        self.rounds += 1
        with self.lock:
            if self._epoch == epoch:
                try:
                    self._apply(local)
                except Exception as exc:  # noqa: BLE001
                    return exc
        return None
