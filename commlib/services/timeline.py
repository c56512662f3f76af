"""Communication timeline: a Chrome trace-event JSON file per rank (opens in Perfetto,
https://ui.perfetto.dev, and chrome://tracing), and :func:`merge` for one trace of all ranks.

Turn it on with ``COMMLIB_TIMELINE=path`` (or ``commlib.options.timeline = path`` before
:func:`commlib.init`, or :func:`start` later, collectively). Rank ``r`` writes
``path.rank{r}.json``: a JSON array of complete events (``"ph": "X"``), one per collective
call (``name`` the operation; ``args``: group, group size, bytes, bus bytes, sequence number
on the group's communicator) and one per DDP bucket exchange (``cat`` ``"ddp"``, from the
launch of the exchange to its completion; ``args``: bucket index, bytes, algorithm,
iteration), each with its thread (``MainThread``, the communication thread
``commlib-comm``, ...) and start and duration in microseconds. Times count from the exit
of an MPI barrier made when the timeline starts, so the ranks' clocks agree to within the
barrier's skew, and :func:`merge` simply puts every rank's events into one trace (one
process per rank). A blocking collective's event is the time this rank spent inside MPI;
an asynchronous one's runs from its start until ``wait()``/``is_completed()`` saw it done.

Off (the default) the cost is one attribute test per collective. On, recording an event
appends a tuple to a list; every :data:`FLUSH_EVERY` events the list is spilled, unformatted
(``marshal``), to ``path.rank{r}.json.raw``, and the JSON is formatted from it when the timeline stops
(:func:`stop`, or interpreter exit), so the training loop never pays for JSON text.
"""
from __future__ import annotations

import atexit
import json
import marshal
import os
import threading
from collections.abc import Iterable
from threading import get_ident
from time import perf_counter, time
from typing import Any

from ..base import accounting
from ..base.options import options
from ..core import runtime
from ..primitives import barrier

FLUSH_EVERY = 4096  # events buffered before they are written


class Timeline:
    """Trace events of this rank, written to ``path`` (a JSON array) at :meth:`close`.

    Recording an event appends one tuple to a list; every :data:`FLUSH_EVERY` events the
    list is spilled unformatted to ``path + ".raw"``; :meth:`close` formats everything."""

    def __init__(self, path: str, rank: int, size: int) -> None:
        self.path, self.rank = path, rank
        self.origin = perf_counter()      # t = 0: right after the start barrier
        self.wall_origin = time()
        self._lock = threading.Lock()
        self._pending: list[tuple] = []
        self._tids: dict[int, int] = {}
        self._names: dict[str, str] = {}  # JSON-escaped strings, formatted once each
        self._parts_cache: dict[tuple, tuple[str, str, str]] = {}
        self._raw = open(path + ".raw", "wb")
        self._closed = False
        self._text: list[str] = [
            self._meta("process_name", 0, {"name": f"rank {rank}"}),
            self._meta("process_sort_index", 0, {"sort_index": rank}),
            json.dumps({"name": "commlib_timeline", "ph": "i", "s": "p", "ts": 0.0,
                        "pid": rank, "tid": 0,
                        "args": {"rank": rank, "world_size": size,
                                 "wall_clock_origin_s": self.wall_origin}})]

    def _meta(self, name: str, tid: int, args: dict[str, Any]) -> str:
        return json.dumps({"name": name, "ph": "M", "pid": self.rank, "tid": tid,
                           "args": args})

    def _tid(self) -> int:
        ident = get_ident()
        tid = self._tids.get(ident)
        if tid is None:
            with self._lock:
                tid = self._tids[ident] = len(self._tids) + 1
                self._text.append(self._meta("thread_name", tid,
                                             {"name": threading.current_thread().name}))
        return tid

    def span(self, name: str, cat: str, t0: float, t1: float, args: dict[str, Any]) -> None:
        """One complete event from ``t0`` to ``t1`` (``time.perf_counter()`` seconds)."""
        self._pending.append((name, cat, t0, t1, self._tid(), args))
        if len(self._pending) >= FLUSH_EVERY:
            self.flush()

    def collective(self, op: str, t0: float, t1: float, comm: Any, what: Any,
                   seq: int) -> None:
        """One collective call (the hot path: a tuple appended)."""
        self._pending.append((op, t0, t1, self._tid(), comm.name, comm.size, seq,
                              getattr(what, "nbytes", -1)))
        if len(self._pending) >= FLUSH_EVERY:
            self.flush()

    def _quoted(self, text: str) -> str:
        q = self._names.get(text)
        if q is None:
            q = self._names[text] = json.dumps(text)
        return q

    def _format(self, events: list[tuple]) -> list[str]:
        origin, pid, out = self.origin, self.rank, []
        cache = self._parts_cache
        template = '%s"ts":%.3f,"dur":%.3f,"args":{"group":%s,"seq":%d%s}}'
        for e in events:
            if len(e) == 6:  # span(name, cat, t0, t1, tid, args)
                name, cat, t0, t1, tid, args = e
                out.append(json.dumps({"name": name, "cat": cat, "ph": "X", "pid": pid,
                                       "tid": tid, "ts": round((t0 - origin) * 1e6, 3),
                                       "dur": round((t1 - t0) * 1e6, 3), "args": args},
                                      separators=(",", ":")))
                continue
            op, t0, t1, tid, group, size, seq, nbytes = e
            key = (op, group, size, nbytes, tid)
            parts = cache.get(key)
            if parts is None:
                parts = cache[key] = self._parts(op, group, size, nbytes, tid)
            out.append(template % (parts[0], (t0 - origin) * 1e6, (t1 - t0) * 1e6, parts[1],
                                   seq, parts[2]))
        return out

    def _parts(self, op: str, group: str, size: int, nbytes: int, tid: int
               ) -> tuple[str, str, str]:
        """The constant pieces of a collective's event text."""
        head = (f'{{"name":{self._quoted(op)},"cat":"collective","ph":"X","pid":{self.rank},'
                f'"tid":{tid},')
        tail = f',"group_size":{size}'
        if isinstance(nbytes, int) and nbytes >= 0:
            bus = accounting.BUS_FACTOR.get(op)
            tail += f',"bytes":{nbytes}' + (f',"bus_bytes":{bus(nbytes, size)}'
                                            if bus is not None else "")
        return head, self._quoted(group), tail

    def flush(self) -> None:
        """Spill the events recorded so far to the raw file (unformatted)."""
        with self._lock:
            if self._closed:
                return
            events, self._pending = self._pending, []
            if events:
                marshal.dump(events, self._raw)

    def close(self) -> None:
        """Format every event into the JSON file and remove the raw one (idempotent)."""
        self.flush()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._raw.close()
            with open(self._raw.name, "rb") as raw, open(self.path, "w",
                                                         encoding="utf-8") as out:
                out.write("[\n" + ",\n".join(self._text))
                while True:
                    try:
                        events = marshal.load(raw)
                    except EOFError:
                        break
                    out.write(",\n" + ",\n".join(self._format(events)))
                out.write("\n]\n")
            os.remove(self._raw.name)


def rank_path(path: str, rank: int) -> str:
    """The file rank ``rank`` writes for ``COMMLIB_TIMELINE=path``."""
    return f"{path}.rank{rank}.json"


def start(path: str | None = None) -> str:
    """Collective over the world: start recording to ``rank_path(path, rank)`` (``path``
    default: ``commlib.options.timeline``) after a barrier that sets every rank's time 0.
    Stops a timeline already running first. Returns this rank's file name."""
    path = path if path is not None else options.timeline
    if not path:
        raise ValueError(f"commlib.services.timeline.start (rank {runtime.get_rank()}): argument "
                         f"'path' is required when commlib.options.timeline is not set")
    stop()
    comm = runtime.world()
    target = rank_path(str(path), comm.rank)
    barrier()
    barrier()  # the second exit is closer in time across ranks than the first
    accounting.tracer = Timeline(target, comm.rank, comm.size)
    return target


def stop() -> str | None:
    """Stop recording and close this rank's file; returns its name (``None`` if off).
    Local: another rank may still be writing its own file when this returns (merging on
    one rank right after it needs a barrier first)."""
    tracer, accounting.tracer = accounting.tracer, None
    if tracer is None:
        return None
    tracer.close()
    return tracer.path


def active() -> bool:
    return accounting.tracer is not None


def load(path: str) -> list[dict[str, Any]]:
    """The events of one trace file (a JSON array, or an object with ``traceEvents``)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def merge(paths: Iterable[str], out: str) -> int:
    """Merge per-rank trace files into one Chrome trace ``out`` (each rank a process, as
    recorded; times already share the origin of the start barrier). Returns the number
    of events written. Not collective: run it on one rank after every rank's
    :func:`stop` (e.g. ``commlib.barrier()`` between the two), or after the job."""
    events: list[dict[str, Any]] = []
    for path in paths:
        events.extend(load(path))
    timed = sorted((e for e in events if e.get("ph") != "M"),
                   key=lambda e: (e.get("ts", 0.0), e.get("pid", 0)))
    merged = [e for e in events if e.get("ph") == "M"] + timed
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, f)
    return len(merged)


def _start_configured() -> None:
    if options.timeline:
        start()


atexit.register(stop)
runtime.on_init(_start_configured)  # COMMLIB_TIMELINE: record from init() on

__all__ = ["Timeline", "active", "load", "merge", "rank_path", "start", "stop"]
