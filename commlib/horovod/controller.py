"""Negotiation by name: Horovod's coordinator, made of commlib collectives.

Horovod matches collectives by *name*, not by the order ranks issue them: two ranks may
submit the same named operations in different orders and still get the right pairs. Each
process set has a :class:`Controller`; submitted requests wait in its table until every
rank of the set has submitted the same name (or has joined), then run, on every rank, in
the same order.

**Rounds.** A rank takes part in negotiation rounds while it has a request that has not
completed (or is joined, or is shutting down): one ``allgather`` over the set's
negotiation group of a fixed 512-byte slot per rank (a second, larger one only when some
rank's announcements do not fit). A slot carries the rank's flags (joined, shutting down)
and its *new* requests since the last round, each as ``(name, metadata)`` - the kind,
dtypes, shapes, device, reduce op, scale factors, root, splits - or, once that exact pair
ran before, as a small integer (Horovod's response cache), so a training step's
announcements cost a few bytes each. Every rank receives the same slots, so every rank
builds the same table and the same list of names in first-announcement order; a name is
*ready* once every rank of the set announced it or has joined. Ready names are checked
(metadata must agree as Horovod requires: same shape and dtype, same op and scale
factors, same root; allgather and alltoall only on the trailing dimensions) and run in
table order on the set's data group; a disagreement fails that request with
:class:`HorovodInternalError` (a ``RuntimeError``) on every rank that submitted it, and
nothing is sent, so nothing hangs or is corrupted. A rank with nothing pending does not
take part in rounds (it computes), so the others wait for it inside the allgather, polling
with short sleeps (no core spun).

**Threads.** With ``MPI_THREAD_MULTIPLE`` the rounds and the data collectives run on the
controller's own thread, so ``*_async`` operations really proceed while the caller
computes (``poll`` is False until the data is in). Without it, ``synchronize`` drives the
rounds on the caller's thread.

**Join.** ``join()`` sets the rank's joined flag: while joined it keeps taking part in
rounds, contributing zeros to every allreduce the other ranks run (the shapes come from
their metadata); any other collective becomes an error on every rank. When every rank has
joined, every rank returns the rank that joined last (the highest rank among those whose
flag first appeared in the latest round), as Horovod does. Automatic names (per-kind
counters) restart from 0 there, on every rank.
"""
from __future__ import annotations

import itertools
import pickle
import threading
import time
from typing import Any, Optional

import numpy as np

from .. import runtime, shutdown as _shutdown
from ..options import options
from ..shutdown import write_stderr
from ..watchdog import abort_job
from ..primitives import allgather, new_group
from . import state as _state

SLOT_BYTES = 512
CACHE_CAPACITY = 1 << 14


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank that took part (Horovod's exception; metadata
    disagreements, operations after another rank joined, shutdown)."""


class Request:
    """One submitted operation (``inputs``/``outputs``: lists of tensors)."""

    __slots__ = ("kind", "name", "meta", "inputs", "outputs", "params", "event", "error",
                 "result", "controller")

    def __init__(self, kind: str, name: str, meta: tuple, inputs: list, outputs: Any,
                 params: dict) -> None:
        self.kind, self.name, self.meta = kind, name, meta
        self.inputs, self.outputs, self.params = inputs, outputs, params
        self.event = threading.Event()
        self.error: Optional[BaseException] = None
        self.result: Any = None
        self.controller: Any = None

    def finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self.result, self.error = result, error
        self.event.set()


_handles: dict[int, Request] = {}
_handle_ids = itertools.count(1)
_handles_lock = threading.Lock()


def new_handle(req: Request) -> int:
    with _handles_lock:
        h = next(_handle_ids)
        _handles[h] = req
    return h


def forget_handles() -> None:
    with _handles_lock:
        _handles.clear()


def poll(handle: int) -> bool:
    """True once the operation behind ``handle`` completed (never blocks; without a
    controller thread it does not drive negotiation either)."""
    req = _handles.get(handle)
    if req is None:
        raise ValueError(f"commlib.horovod.poll: unknown handle {handle!r}")
    return req.event.is_set()


def synchronize(handle: int) -> Any:
    """Wait for the operation behind ``handle``; return its output (the output tensor, a
    list for grouped operations, ``(output, received_splits)`` for alltoall). Raises the
    operation's :class:`HorovodInternalError` on failure. ``None`` for an unknown
    handle, as Horovod."""
    with _handles_lock:
        req = _handles.get(handle)
    if req is None:
        return None
    try:
        req.controller.wait(req)
    finally:
        with _handles_lock:
            _handles.pop(handle, None)
    if req.error is not None:
        raise req.error
    return req.result


class Controller:
    """Negotiation and execution for one process set (see the module docstring). Built on
    every rank of the Horovod world (collective over it: two commlib groups of the set's
    ranks); non-members get an inert controller."""

    def __init__(self, st: Any, ranks: list, label: str) -> None:
        self.label = label
        same = list(ranks) == list(range(st.size))
        parent = st.group
        world_ranks = [parent.ranks[r] for r in ranks]
        self.neg = new_group(None if same else world_ranks, parent=parent)
        self.data = new_group(None if same else world_ranks, parent=parent)
        self.member = self.neg.is_member
        self.ranks = list(ranks)             # Horovod-world ranks, sorted
        self.rank = self.neg.rank
        self.size = len(ranks)
        self.threaded = runtime.thread_multiple()
        self.lock = threading.Condition()
        self.unannounced: list[Request] = []
        self.pending: dict[str, Request] = {}   # this rank's requests by name, not done
        self.table: dict[str, dict[int, tuple]] = {}
        self.order: list[str] = []
        self.cache: dict[int, tuple] = {}
        self.my_cache: dict[tuple, int] = {}
        self.next_cid = 0
        self.counters: dict[str, int] = {}
        self.joined = False
        self.join_req: Optional[Request] = None
        self.join_round: dict[int, int] = {}
        self.rounds = 0
        self.first_seen: dict[str, float] = {}   # name -> when its first announcement came
        self.warned: set = set()
        self.stopping = False
        self.closed = False
        self.fatal: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._driving = threading.Lock()

    # -- submission (caller's thread) ------------------------------------------------------
    def auto_name(self, kind: str) -> str:
        n = self.counters.get(kind, 0)
        self.counters[kind] = n + 1
        return f"{kind}.noname.{n}"

    def submit(self, req: Request) -> int:
        """Queue ``req`` for negotiation; returns its handle. A name already pending on
        this rank raises ``ValueError`` (Horovod's duplicate-name error)."""
        if not self.member:
            raise ValueError(f"commlib.horovod.{req.kind} (rank {_state.current.rank}): this "
                             f"process is not a member of the process set {self.ranks}")
        if self.closed or self.stopping:
            raise HorovodInternalError(f"commlib.horovod.{req.kind}: Horovod has been shut down")
        req.controller = self
        with self.lock:
            if req.name in self.pending:
                raise ValueError(f"commlib.horovod.{req.kind} (rank {self.rank}): a collective "
                                 f"named {req.name!r} is already pending on this rank (Horovod "
                                 f"requires unique names among outstanding operations)")
            self.pending[req.name] = req
            self.unannounced.append(req)
            self._wake()
        return new_handle(req)

    def join(self) -> int:
        """Join (see the module docstring); returns the last rank to join."""
        req = Request("join", "join", ("join",), [], None, {})
        req.controller = self
        with self.lock:
            self.joined = True
            self.join_req = req
            self._wake()
        self.wait(req)
        if req.error is not None:
            raise req.error
        return req.result

    def _wake(self) -> None:
        if self.threaded:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name=f"commlib-horovod-{self.label}")
                self._thread.start()
                _shutdown.register(self)
            self.lock.notify_all()

    def wait(self, req: Request) -> None:
        if self.threaded:
            while not req.event.wait(0.5):
                if self.fatal is not None and not req.event.is_set():
                    raise HorovodInternalError(f"commlib.horovod: the negotiation thread of "
                                               f"{self.label} failed: {self.fatal}")
            return
        with self._driving:
            while not req.event.is_set():
                self._round()

    # -- the negotiation thread ------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self.unannounced or self.pending or self.joined or self.stopping)

    def _loop(self) -> None:
        backoff = 0.0
        try:
            while True:
                with self.lock:
                    while not self._has_work():
                        self.lock.wait()
                progressed = self._round()
                if self.closed:
                    return
                if progressed:
                    backoff = 0.0
                else:  # every rank is in rounds but nothing matched yet: do not spin
                    backoff = min(1e-3, backoff * 2 or 5e-5)
                    time.sleep(backoff)
        except BaseException as exc:  # noqa: BLE001 - failed requests carry it
            self.fatal = exc
            self._fail_all(HorovodInternalError(f"commlib.horovod: negotiation failed on "
                                                f"{self.label}: {exc!r}"))

    def _exchange(self, payload: bytes) -> list[bytes]:
        """One round's allgather of every rank's slot."""
        slot = np.zeros(SLOT_BYTES, dtype=np.uint8)
        slot[:4] = np.frombuffer(np.uint32(len(payload)).tobytes(), dtype=np.uint8)
        fits = len(payload) <= SLOT_BYTES - 4
        if fits:
            slot[4:4 + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        work = allgather(slot, group=self.neg, async_op=True)
        for _ in range(64):
            if work.is_completed():
                break
            time.sleep(0)
        slots = work.wait(poll_s=2e-4)
        lengths = [int(np.frombuffer(s[:4].tobytes(), dtype=np.uint32)[0]) for s in slots]
        longest = max(lengths)
        if longest > SLOT_BYTES - 4:   # somebody's announcements did not fit: send them all
            big = np.zeros(longest, dtype=np.uint8)
            big[:len(payload)] = np.frombuffer(payload, dtype=np.uint8)
            full = allgather(big, group=self.neg)
            return [full[r, :lengths[r]].tobytes() for r in range(self.size)]
        return [slots[r, 4:4 + lengths[r]].tobytes() for r in range(self.size)]

    def _round(self) -> bool:
        """One negotiation round and the execution of what became ready; True when it
        made progress (something announced, run, joined or stopped)."""
        with self.lock:
            new, self.unannounced = self.unannounced, []
            flags = (1 if self.joined else 0) | (2 if self.stopping else 0)
        items = [self.my_cache.get((r.name, r.meta), (r.name, r.meta)) for r in new]
        payload = pickle.dumps((flags, items), protocol=4) if (items or flags) else b""
        slots = self._exchange(payload)
        self.rounds += 1
        joined, stopping, announced = set(), 0, 0
        for r, data in enumerate(slots):
            f, its = pickle.loads(data) if data else (0, [])
            if f & 1:
                joined.add(r)
                self.join_round.setdefault(r, self.rounds)
            stopping += bool(f & 2)
            for it in its:
                name, meta = (it[0], it[1]) if isinstance(it, tuple) else \
                    (self.cache[it][0], self.cache[it][1][r])
                slot = self.table.get(name)
                if slot is None:
                    slot = self.table[name] = {}
                    self.order.append(name)
                    self.first_seen[name] = time.monotonic()
                slot[r] = meta
                announced += 1
        ready = [n for n in self.order
                 if all(r in self.table[n] or r in joined for r in range(self.size))]
        if ready:
            self._run(ready, joined)
        if self.order and self.rounds % 64 == 0:
            self._check_stalls(joined)
        done_join = len(joined) == self.size
        if done_join:
            last = max(self.join_round.values())
            winner = max(r for r, k in self.join_round.items() if k == last)
            with self.lock:
                self.joined = False
                req, self.join_req = self.join_req, None
            self.join_round = {}
            # A common point on every rank: unnamed operations count from 0 again, so the
            # ones that failed on some ranks only (collectives after a rank joined) do not
            # leave the ranks' automatic names apart.
            self.counters = {}
            if req is not None:
                req.finish(self.ranks[winner])
        if stopping == self.size:
            self._fail_all(HorovodInternalError("commlib.horovod: Horovod has been shut down "
                                                "before this operation could complete"))
            self.closed = True
        return bool(announced or ready or done_join or stopping)

    def _check_stalls(self, joined: set) -> None:
        """Horovod's stall check: a name some ranks submitted and others not, for 60 s, is
        reported; past ``COMMLIB_TIMEOUT`` the job is aborted (it would never complete)."""
        now = time.monotonic()
        for name in self.order:
            age = now - self.first_seen.get(name, now)
            missing = [self.ranks[r] for r in range(self.size)
                       if r not in self.table[name] and r not in joined]
            if age > options.timeout:
                abort_job(f"[commlib.horovod] rank {self.ranks[self.rank]}: collective "
                          f"{name!r} on {self.label} was submitted by some ranks but never by "
                          f"ranks {missing} for {age:.0f} s (COMMLIB_TIMEOUT); aborting the job")
            if age > 60 and name not in self.warned:
                self.warned.add(name)
                write_stderr(f"[commlib.horovod] rank {self.ranks[self.rank]}: stalled: "
                             f"{name!r} is waiting for ranks {missing} since {age:.0f} s\n")

    def _run(self, ready: list, joined: set) -> None:
        from .execute import check, run
        batch = []
        for name in ready:
            metas = [self.table[name].get(r) for r in range(self.size)]
            del self.table[name]
            self.first_seen.pop(name, None)
            with self.lock:
                req = self.pending.pop(name, None)
            error = check(name, metas, joined, self.ranks)
            if error is not None:
                if req is not None:
                    req.finish(error=HorovodInternalError(error))
                continue
            if self.next_cid < CACHE_CAPACITY:
                cid, self.next_cid = self.next_cid, self.next_cid + 1
                self.cache[cid] = (name, metas)
                if req is not None:
                    self.my_cache[(name, req.meta)] = cid
            batch.append((name, metas, req))
        self.order = [n for n in self.order if n in self.table]
        run(self, batch)

    def _fail_all(self, error: BaseException) -> None:
        with self.lock:
            reqs = list(self.pending.values()) + ([self.join_req] if self.join_req else [])
            self.pending.clear()
            self.unannounced = []
            self.join_req = None
            self.joined = False
        for req in reqs:
            if not req.event.is_set():
                req.finish(error=error)

    # -- shutdown --------------------------------------------------------------------------
    def close(self) -> None:
        """Collective over the set: stop after a round in which every member is stopping
        (pending requests fail), then free the groups."""
        if self.closed or not self.member:
            self._free()
            return
        with self.lock:
            self.stopping = True
            self._wake()
        if self.threaded and self._thread is not None:
            self._thread.join()
            self._thread = None
            _shutdown.unregister(self)
        else:
            with self._driving:
                while not self.closed:
                    self._round()
        self._free()

    def _free(self) -> None:
        self.closed = True
        for g in (self.neg, self.data):
            if g.is_member:
                g.free()

    def stop_at_exit(self, deadline: float) -> bool:
        """:mod:`commlib.shutdown`: a script that never called ``hvd.shutdown()``."""
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
            return not thread.is_alive()
        return True
