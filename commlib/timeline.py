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

Off (the default) the cost is one attribute test per collective. The file is written as
events arrive (in chunks) and closed at :func:`stop` or interpreter exit.
"""
from __future__ import annotations

import atexit
import json
import threading
from time import perf_counter, time
from typing import Any, Iterable

from . import accounting

FLUSH_EVERY = 4096  # events buffered before they are written


class Timeline:
    """Trace events of this rank, written to ``path`` (a JSON array)."""

    def __init__(self, path: str, rank: int, size: int) -> None:
        self.path, self.rank = path, rank
        self.origin = perf_counter()      # t = 0: right after the start barrier
        self.wall_origin = time()
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._tids: dict[int, int] = {}
        self._file = open(path, "w", encoding="utf-8")
        self._file.write("[\n")
        self._first = True
        self._closed = False
        self._meta("process_name", 0, {"name": f"rank {rank}"})
        self._meta("process_sort_index", 0, {"sort_index": rank})
        self._events.append({"name": "commlib_timeline", "ph": "i", "s": "p", "ts": 0.0,
                             "pid": rank, "tid": 0,
                             "args": {"rank": rank, "world_size": size,
                                      "wall_clock_origin_s": self.wall_origin}})

    def _meta(self, name: str, tid: int, args: dict[str, Any]) -> None:
        self._events.append({"name": name, "ph": "M", "pid": self.rank, "tid": tid,
                             "args": args})

    def _tid(self) -> int:
        ident = threading.get_ident()
        tid = self._tids.get(ident)
        if tid is None:
            tid = self._tids[ident] = len(self._tids) + 1
            self._meta("thread_name", tid, {"name": threading.current_thread().name})
        return tid

    def span(self, name: str, cat: str, t0: float, t1: float, args: dict[str, Any]) -> None:
        """One complete event from ``t0`` to ``t1`` (``time.perf_counter()`` seconds)."""
        with self._lock:
            if self._closed:
                return
            self._events.append({"name": name, "cat": cat, "ph": "X", "pid": self.rank,
                                 "tid": self._tid(), "ts": round((t0 - self.origin) * 1e6, 3),
                                 "dur": round((t1 - t0) * 1e6, 3), "args": args})
            if len(self._events) >= FLUSH_EVERY:
                self._flush()

    def collective(self, op: str, t0: float, t1: float, comm: Any, what: Any,
                   seq: int) -> None:
        nbytes = getattr(what, "nbytes", None)
        args: dict[str, Any] = {"group": comm.name, "group_size": comm.size, "seq": seq}
        if isinstance(nbytes, int):
            bus = accounting.BUS_FACTOR.get(op)
            args["bytes"] = nbytes
            if bus is not None:
                args["bus_bytes"] = bus(nbytes, comm.size)
        self.span(op, "collective", t0, t1, args)

    def _flush(self) -> None:
        if self._events:
            text = ",\n".join(json.dumps(e, separators=(",", ":")) for e in self._events)
            self._file.write(text if self._first else ",\n" + text)
            self._first = False
            self._events = []

    def close(self) -> None:
        """Write what is buffered and end the JSON array (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._flush()
            self._file.write("\n]\n")
            self._file.close()
            self._closed = True


def rank_path(path: str, rank: int) -> str:
    """The file rank ``rank`` writes for ``COMMLIB_TIMELINE=path``."""
    return f"{path}.rank{rank}.json"


def start(path: str | None = None) -> str:
    """Collective over the world: start recording to ``rank_path(path, rank)`` (``path``
    default: ``commlib.options.timeline``) after a barrier that sets every rank's time 0.
    Stops a timeline already running first. Returns this rank's file name."""
    from .options import options
    from .primitives import barrier
    from . import runtime
    path = path if path is not None else options.timeline
    if not path:
        raise ValueError(f"commlib.timeline.start (rank {runtime.get_rank()}): argument "
                         f"'path' is required when commlib.options.timeline is not set")
    stop()
    comm = runtime.world()
    target = rank_path(str(path), comm.rank)
    barrier()
    barrier()  # the second exit is closer in time across ranks than the first
    accounting.tracer = Timeline(target, comm.rank, comm.size)
    return target


def stop() -> str | None:
    """Stop recording and close this rank's file; returns its name (``None`` if off)."""
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
    of events written. Not collective: run it on one rank or after the job."""
    events: list[dict[str, Any]] = []
    for path in paths:
        events.extend(load(path))
    timed = sorted((e for e in events if e.get("ph") != "M"),
                   key=lambda e: (e.get("ts", 0.0), e.get("pid", 0)))
    merged = [e for e in events if e.get("ph") == "M"] + timed
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, f)
    return len(merged)


atexit.register(stop)

__all__ = ["Timeline", "active", "load", "merge", "rank_path", "start", "stop"]
