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

**Tiny allreduces** (CPU, one tensor of at most 128 bytes, float32/64 or integers, not
Adasum: :mod:`commlib.horovod.wire`) carry their input inline in the slot; when they are
ready every rank reduces the gathered bytes itself, in rank order, so such an allreduce
costs one allgather in all. **The common round** - every rank announced exactly the same
thing and nothing else is outstanding (the same decision on every rank: it compares the
gathered slots) - skips the table: its items are ready and agree.
(The blocking tiny allreduce's express lane is :mod:`commlib.horovod.express`.)

**Threads.** With ``MPI_THREAD_MULTIPLE`` the rounds and the data collectives run on the
controller's own thread, so ``*_async`` operations really proceed while the caller
computes (``poll`` is False until the data is in). A blocking operation (``allreduce``,
``broadcast``, ... through :func:`call`) does not hand off: when no round is under way on
this rank, the caller's thread drives the rounds itself until its operation is done (one
thread at a time drives, under a lock; the rounds' allgather is always the nonblocking
one, since MPI matches a blocking collective only with blocking ones). Without
``MPI_THREAD_MULTIPLE``, ``synchronize`` drives the rounds on the caller's thread.

**Join.** ``join()`` sets the rank's joined flag: while joined it keeps taking part in
rounds, contributing zeros to every allreduce the other ranks run (the shapes come from
their metadata); any other collective becomes an error on every rank. When every rank has
joined, every rank returns the rank that joined last (the highest rank among those whose
flag first appeared in the latest round), as Horovod does. Automatic names (per-kind
counters) restart from 0 there, on every rank.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from ..base.options import options
from ..core import runtime
from ..mpi import shutdown as _shutdown
from ..mpi.shutdown import write_stderr
from ..mpi.watchdog import abort_job
from ..primitives import allgather, new_group
from . import state as _state
from . import wire
from .execute import check, inline_allreduce, run
from .express import _LENGTH, SLOT_BYTES, ExpressLane
from .requests import (  # noqa: F401 (re-exported)
    HorovodInternalError,
    Request,
    _tls,
    call,
    forget_handles,
    new_handle,
    poll,
    synchronize,
)

CACHE_CAPACITY = 1 << 14


class Controller(ExpressLane):
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
        self.mutex = threading.Lock()
        self.lock = threading.Condition(self.mutex)   # waits for work (the thread)
        self.unannounced: list[Request] = []
        self.pending: dict[str, Request] = {}   # this rank's requests by name, not done
        self.table: dict[str, dict[int, tuple]] = {}
        self.order: list[str] = []
        self.cache: dict[int, tuple] = {}
        self.cache_ids: dict[tuple, int] = {}
        self.my_cache: dict[tuple, int] = {}
        self.next_cid = 0
        self.counters: dict[str, int] = {}
        self.joined = False
        self.join_req: Request | None = None
        self.join_round: dict[int, int] = {}
        self.rounds = 0
        self.first_seen: dict[str, float] = {}   # name -> when its first announcement came
        self.warned: set = set()
        self.stopping = False
        self.closed = False
        self.fatal: BaseException | None = None
        self.inline: dict[str, dict[int, tuple]] = {}   # name -> rank -> (slot, offset)
        self._slot = np.zeros(SLOT_BYTES, dtype=np.uint8)
        self._slot_view = memoryview(self._slot)
        self._rows = np.zeros((self.size, SLOT_BYTES), dtype=np.uint8)
        self._thread: threading.Thread | None = None
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
        with self.mutex:
            if req.name in self.pending:
                raise ValueError(f"commlib.horovod.{req.kind} (rank {self.rank}): a collective "
                                 f"named {req.name!r} is already pending on this rank (Horovod "
                                 f"requires unique names among outstanding operations)")
            self.pending[req.name] = req
            self.unannounced.append(req)
            if _tls.__dict__.get("defer"):
                return req   # for call(): it waits on this thread
            self._wake()
        return new_handle(req)

    def join(self) -> int:
        """Join (see the module docstring); returns the last rank to join."""
        req = Request("join", "join", ("join",), [], None, {})
        req.controller = self
        with self.mutex:
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
        if req.done:
            return
        if self.threaded:
            # Nobody is in a round on this rank: drive them here, no hand-off (waiting in
            # MPI, as commlib's own blocking collectives wait). Join waits politely
            # on the thread instead (it may wait long for the others).
            if req.kind != "join" and self._driving.acquire(blocking=False):
                try:
                    while not req.done and not self.closed:
                        if not self._round(spin=True):
                            time.sleep(5e-5)
                finally:
                    self._driving.release()
                if req.done:
                    return
            with self.mutex:
                self._wake()
            while not req.wait_done(0.5):
                if self.fatal is not None and not req.done:
                    raise HorovodInternalError(f"commlib.horovod: the negotiation thread of "
                                               f"{self.label} failed: {self.fatal}")
            return
        with self._driving:
            while not req.done:
                self._round()

    # -- the negotiation thread ------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self.unannounced or self.pending or self.joined or self.stopping)

    def _loop(self) -> None:
        backoff = 0.0
        try:
            while True:
                with self.mutex:
                    while not self._has_work():
                        self.lock.wait()
                if self.closed:
                    return
                with self._driving:   # a blocked caller may be driving the rounds
                    if self.closed:
                        return
                    if not self._has_work():
                        continue
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

    def _exchange(self, payload: bytes, spin: bool = False) -> tuple:
        """One round's allgather of every rank's slot (``spin``: waited for in MPI, else
        polled with short sleeps)."""
        slot, n = self._slot, len(payload)
        _LENGTH.pack_into(self._slot_view, 0, n)
        if n <= SLOT_BYTES - 4:
            self._slot_view[4:4 + n] = payload
        # Always the nonblocking allgather: MPI does not match a blocking collective
        # with a nonblocking one, and another rank may be in this round on its thread.
        work = allgather(slot, group=self.neg, async_op=True)
        if spin:
            slots = work.wait()
        else:
            for _ in range(64):
                if work.is_completed():
                    break
                time.sleep(0)
            slots = work.wait(poll_s=2e-4)
        lengths = slots.view(np.uint32)[:, 0]
        longest = int(lengths.max())
        if longest > SLOT_BYTES - 4:   # somebody's announcements did not fit: send them all
            big = np.zeros(longest, dtype=np.uint8)
            big[:len(payload)] = np.frombuffer(payload, dtype=np.uint8)
            full = allgather(big, group=self.neg)
            return [full[r, :lengths[r]].tobytes() for r in range(self.size)], None
        return lengths, slots

    def _round(self, spin: bool = False) -> bool:
        """One negotiation round and the execution of what became ready; True when it
        made progress (something announced, run, joined or stopped)."""
        with self.mutex:
            new, self.unannounced = self.unannounced, []
            flags = (1 if self.joined else 0) | (2 if self.stopping else 0)
        cached, fresh = [], []
        for req in new:
            cid = self.my_cache.get((req.name, req.meta))
            if cid is None:
                fresh.append(req)
            else:
                cached.append((cid, req))
        payload = wire.encode(flags, cached, fresh)
        slots, rows = self._exchange(payload, spin)
        self.rounds += 1
        if rows is not None:
            if new and not flags and not self.table and self._fast(payload, rows, cached, fresh):
                return True
            slots = [rows[r, 4:4 + n].tobytes() for r, n in enumerate(slots.tolist())]
        return self._digest(slots)

    def _digest(self, slots: list) -> bool:
        """A round's gathered slots (bytes per rank) into the table; run what is ready."""
        joined, stopping, announced = set(), 0, 0
        for r, data in enumerate(slots):
            if not data:
                continue
            f, cids, its, o = wire.decode(data)
            if f & 1:
                joined.add(r)
                self.join_round.setdefault(r, self.rounds)
            stopping += bool(f & 2)
            for name, meta in [(self.cache[c][0], self.cache[c][1][r]) for c in cids] + list(its):
                slot = self.table.get(name)
                if slot is None:
                    slot = self.table[name] = {}
                    self.order.append(name)
                    self.first_seen[name] = time.monotonic()
                slot[r] = meta
                n = wire.inline_nbytes(meta)
                if n:
                    self.inline.setdefault(name, {})[r] = (data, o)
                    o += n
                announced += 1
        size = self.size
        ready = [n for n in self.order
                 if len(self.table[n]) == size
                 or all(r in self.table[n] or r in joined for r in range(size))]
        if ready:
            self._run(ready, joined)
        if self.order and self.rounds % 64 == 0:
            self._check_stalls(joined)
        done_join = len(joined) == self.size
        if done_join:
            last = max(self.join_round.values())
            winner = max(r for r, k in self.join_round.items() if k == last)
            with self.mutex:
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

    def _cache_id(self, name: str, metas: list, req: Request | None,
                  mine: tuple | None = None) -> None:
        """The response cache: the same id on every rank for a ``(name, metas)`` that ran
        (``mine``: this rank's metadata when there is no request). Automatic names are
        not cached (they do not repeat; the same decision on every rank)."""
        if ".noname." in name:
            return
        key = (name, tuple(metas))
        cid = self.cache_ids.get(key)
        if cid is None:
            if self.next_cid >= CACHE_CAPACITY:
                return
            cid, self.next_cid = self.next_cid, self.next_cid + 1
            self.cache[cid] = (name, metas)
            self.cache_ids[key] = cid
        if req is not None:
            mine = req.meta
        if mine is not None:
            self.my_cache[(name, mine)] = cid

    def _fast(self, payload: bytes, rows: Any, cached: list, fresh: list) -> bool:
        """The common round: every rank announced exactly what this rank announced (the
        same slot but for the inline data) and nothing else is outstanding, so every item
        is ready on every rank (the same decision everywhere). A fresh item's metadata is
        the same on every rank; a cached one's are its cache entry's, one per rank (an
        allgather's or alltoall's first dimension or splits may differ between ranks
        that all announce the same id)."""
        o = 4 + wire.prefix_len(payload)
        head = rows[:, :o]
        if self.size > 1 and not (head == head[self.rank]).all():
            return False
        batch = []
        items = [(req, self.cache[cid][1]) for cid, req in cached]
        items += [(req, [req.meta] * self.size) for req in fresh]
        for req, metas in items:
            name = req.name
            with self.mutex:
                self.pending.pop(name, None)
            self._cache_id(name, metas, req)
            n = wire.inline_nbytes(req.meta)
            if n:
                inline_allreduce(self, req, rows[:, o:o + n].copy())
                o += n
            else:
                batch.append((name, metas, req, None))
        if batch:
            run(self, batch)
        return True

    def _run(self, ready: list, joined: set) -> None:
        batch = []
        for name in ready:
            metas = [self.table[name].get(r) for r in range(self.size)]
            del self.table[name]
            self.first_seen.pop(name, None)
            with self.mutex:
                req = self.pending.pop(name, None)
            error = check(name, metas, joined, self.ranks)
            if error is not None:
                self.inline.pop(name, None)
                if req is not None:
                    req.finish(error=HorovodInternalError(error))
                continue
            self._cache_id(name, metas, req)
            inline = self.inline.pop(name, None)
            if inline is not None:   # joined ranks' rows stay zero
                nb = wire.inline_nbytes(next(m for m in metas if m is not None))
                raw = np.zeros((self.size, nb), dtype=np.uint8)
                for r, (data, o) in inline.items():
                    raw[r] = np.frombuffer(data, dtype=np.uint8, count=nb, offset=o)
                inline = raw
            batch.append((name, metas, req, inline))
        self.order = [n for n in self.order if n in self.table]
        run(self, batch)

    def _fail_all(self, error: BaseException) -> None:
        with self.mutex:
            reqs = list(self.pending.values()) + ([self.join_req] if self.join_req else [])
            self.pending.clear()
            self.unannounced = []
            self.join_req = None
            self.joined = False
        for req in reqs:
            if not req.done:
                req.finish(error=error)

    # -- shutdown --------------------------------------------------------------------------
    def close(self) -> None:
        """Collective over the set: stop after a round in which every member is stopping
        (pending requests fail), then free the groups."""
        if self.closed or not self.member:
            self._free()
            return
        with self.mutex:
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

    def abandon(self) -> None:
        """After a peer failure: stop without a collective; pending requests fail."""
        self._fail_all(HorovodInternalError(f"commlib.horovod: a peer of {self.label} died"))
        with self.mutex:
            self.closed = True
            self.stopping = True
            self.lock.notify_all()
        if self._thread is not None:
            _shutdown.unregister(self)
            self._thread = None   # it leaves on its own (its round fails, or it sees closed)

    def _free(self) -> None:
        self.closed = True
        for g in (self.neg, self.data):
            if g.is_member:
                g.free()

    def stop_at_exit(self, deadline: float) -> bool:
        """:mod:`commlib.mpi.shutdown`: a script that never called ``hvd.shutdown()``."""
        with self.mutex:
            self.stopping = True
            self.lock.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
            return not thread.is_alive()
        return True
