"""Where commlib's per-call host time goes: each step of a small collective, timed alone.

    python benchmarks/profile_overhead.py [--size 8] [--torch] [--cprofile] [--json PATH]

Runs in one process (an MPI singleton; no mpiexec needed), so every number is pure host
time with no peer to wait for: the full commlib call, the raw mpi4py call it wraps, and
each bookkeeping step of ``commlib.allreduce`` on its own (buffer adaptation, reduce-op
lookup, checking-mode test, byte counters, watchdog arm/disarm, result finishing), plus
the full calls of the other collectives. Each row is the best of ``--repeat`` loops of
``--number`` calls; rows take turns so that machine noise hits all of them alike. This is
a diagnostic for commlib's developers: it calls commlib internals
(``commlib.base.buffers.adapt``, ``commlib.base.accounting.record``...) by name.

``--evict 8M`` copies that many bytes before every call (only the call is timed), as a large MPI transfer does between two calls of a training loop: the same
Python bookkeeping then runs with cold caches and costs several times more, which is why
commlib's added time per call grows with the message size in ``bench_collectives.py``.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import math
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def best_ns(fns: dict[str, Callable[[], Any]], number: int, repeat: int) -> dict[str, float]:
    """Per row, the fastest of ``repeat`` loops of ``number`` calls (ns per call). Rows take
    turns (round robin), so a slow phase of the machine hits every row alike."""
    best = dict.fromkeys(fns, math.inf)
    for fn in fns.values():
        for _ in range(min(number, 1000)):
            fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / number * 1e9)
    return best


def steps(count: int, use_torch: bool) -> dict[str, Callable[[], Any]]:
    """The full allreduce, its raw peer, and each step of commlib's allreduce path."""
    import commlib
    # isort: split
    from mpi4py import MPI

    from commlib.base import buffers
    from commlib.base.reduce_ops import ReduceOp, mpi_op
    from commlib.core import runtime
    from commlib.primitives import _base
    counters = importlib.import_module("commlib.base.accounting")
    arr = np.zeros(count, np.float32)
    obj = arr
    if use_torch:
        import torch
        obj = torch.from_numpy(arr)
    comm, peer = runtime.world(), MPI.COMM_WORLD.Dup()
    buf = buffers.adapt(obj, "tensor", "allreduce", 0, write=True)
    msg, n = [arr, count, MPI.FLOAT], comm.size
    return {
        "commlib.allreduce (total)": lambda: commlib.allreduce(obj),
        "raw comm.Allreduce(IN_PLACE, [a, n, FLOAT], SUM)":
            lambda: peer.Allreduce(MPI.IN_PLACE, msg, MPI.SUM),
        "  resolve(group=None)": lambda: _base.resolve(None, "allreduce"),
        "  buffers.adapt(tensor, write=True)":
            lambda: buffers.adapt(obj, "tensor", "allreduce", 0, write=True),
        "  reduce_ops.mpi_op(SUM, float32)": lambda: mpi_op(ReduceOp.SUM, buf.dt, "ar", 0),
        "  comm.checking (options.check lookup)": lambda: comm.checking,
        "  accounting.record (async calls)": lambda: counters.record("allreduce",
                                                                    buf.nbytes, n),
        "  accounting.record_timed (blocking calls: counts + seconds)":
            lambda: counters.record_timed("allreduce", 8, 0.0, 1e-6, comm, buf),
        "  buf.nbytes": lambda: buf.nbytes,
        "  comm.arm + comm.disarm (watchdog)": lambda: (comm.arm("allreduce", buf),
                                                         comm.disarm()),
        "  buf.msg()": lambda: buf.msg(),
        "  finish_reduce(SUM)": lambda: _base.finish_reduce(buf, ReduceOp.SUM, n),
        "buffers.output (new result buffer)":
            lambda: buffers.output(buf, (n, count), "allgather", 0),
        "  accounting.timed (stats seconds; timeline off)":
            lambda: counters.timed("allreduce", 0.0, 1e-6, comm, buf, 1),
        "commlib.allreduce, timeline on (total)": lambda: traced(commlib.allreduce, obj),
        "  tracer switch alone (subtracted above)": lambda: traced(_noop, obj),
        "commlib.reduce (total)": lambda: commlib.reduce(obj),
        "commlib.broadcast (total)": lambda: commlib.broadcast(obj),
        "commlib.allgather (total)": lambda: commlib.allgather(obj),
        "commlib.reduce_scatter (total)": lambda: commlib.reduce_scatter(obj),
        "commlib.alltoall (total)": lambda: commlib.alltoall(obj),
        "commlib.barrier (total)": lambda: commlib.barrier(),
        **(torch_steps(obj) if use_torch else {}),
    }


_TRACER: Any = None


def _noop(obj: Any) -> Any:
    return obj


def traced(fn: Callable[[Any], Any], obj: Any) -> Any:
    """``fn(obj)`` with the timeline on (a real trace file, flushed as it fills)."""
    accounting = sys.modules["commlib.base.accounting"]
    accounting.tracer = _TRACER
    try:
        return fn(obj)
    finally:
        accounting.tracer = None


def torch_steps(t: Any) -> dict[str, Callable[[], Any]]:
    """What ``buffers.adapt`` does with a CPU torch tensor, step by step."""
    from commlib.base import dtypes, host_views, options
    dt = dtypes.from_torch(t.dtype)
    return {
        "torch adapt: dtypes.from_torch(t.dtype)": lambda: dtypes.from_torch(t.dtype),
        "torch adapt: t.requires_grad": lambda: t.requires_grad,
        "torch adapt: t.detach()": lambda: t.detach(),
        "torch adapt: t.device.type": lambda: t.device.type,
        "torch adapt: options.force_staging": lambda: options.force_staging,
        "torch adapt: t.is_contiguous()": lambda: t.is_contiguous(),
        "torch adapt: t.numpy()": lambda: t.numpy(),
        "torch adapt: host_views.view(t) (cached view)":
            lambda: host_views.view(t, t.dtype, dt),
        "torch adapt: tuple(t.shape)": lambda: tuple(t.shape),
    }


def cold_ns(fns: dict[str, Callable[[], Any]], nbytes: int, number: int,
            repeat: int) -> dict[str, float]:
    """Like :func:`best_ns`, but every call follows a copy of ``nbytes`` (cold caches) and
    only the call itself is timed; the median over ``repeat`` loops (a best-of would pick
    the loops where the copy happened to leave the caches warm)."""
    src, dst = np.ones(nbytes // 8, np.float64), np.empty(nbytes // 8, np.float64)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    clock = time.perf_counter
    for _ in range(repeat):
        for name, fn in fns.items():
            spent = 0.0
            for _ in range(number):
                np.copyto(dst, src)
                t0 = clock()
                fn()
                spent += clock() - t0
            samples[name].append(spent / number * 1e9)
    return {name: statistics.median(v) for name, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=C.parse_size, default=8, help="buffer bytes (8 B)")
    p.add_argument("--torch", action="store_true", help="CPU torch tensor instead of numpy")
    p.add_argument("--number", type=int, default=2000, help="calls per timed loop")
    p.add_argument("--repeat", type=int, default=40, help="timed loops; the best is kept")
    p.add_argument("--evict", type=C.parse_size, default=0,
                   help="copy this many bytes before every call (cold caches; e.g. 8M)")
    p.add_argument("--cprofile", action="store_true",
                   help="also print cProfile's top functions for commlib.allreduce")
    p.add_argument("--json", type=Path, help="write the rows as JSON")
    args = p.parse_args(argv)
    import tempfile

    import commlib
    from commlib.services import timeline
    commlib.init()
    global _TRACER
    trace_dir = tempfile.mkdtemp(prefix="commlib-timeline-")
    _TRACER = timeline.Timeline(timeline.rank_path(f"{trace_dir}/trace", 0), 0, 1)
    count = max(1, args.size // 4)
    rows_fns = steps(count, args.torch)
    if args.evict:
        table = cold_ns(rows_fns, args.evict, max(1, args.number // 20), args.repeat)
    else:
        table = best_ns(rows_fns, args.number, args.repeat)
    total = table["commlib.allreduce (total)"]
    raw = table["raw comm.Allreduce(IN_PLACE, [a, n, FLOAT], SUM)"]
    # The trace is spilled every FLUSH_EVERY events: a best-of over short loops would pick
    # loops without a spill. So: loops of exactly FLUSH_EVERY calls (one spill each when
    # on), off and on alternating, and the median of the per-pair differences (adjacent
    # loops share the machine's state, which makes the difference robust to load).
    from commlib.base import accounting
    buf = np.zeros(count, np.float32)
    if args.torch:
        import torch
        buf = torch.from_numpy(buf)
    calls = timeline.FLUSH_EVERY
    pairs: list[float] = []
    per_state: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(max(10, args.repeat * 2)):
        spent = {}
        for state in ("off", "on"):
            accounting.tracer = _TRACER if state == "on" else None
            t0 = time.perf_counter()
            for _ in range(calls):
                commlib.allreduce(buf)
            spent[state] = (time.perf_counter() - t0) / calls * 1e9
            accounting.tracer = None
            per_state[state].append(spent[state])
        pairs.append(spent["on"] - spent["off"])
    amortized = {k: statistics.median(v) for k, v in per_state.items()}
    t_close = time.perf_counter()
    _TRACER.close()
    close_ns = (time.perf_counter() - t_close) * 1e9 / max(1, len(timeline.load(_TRACER.path)))
    traced_added = statistics.median(pairs)
    rows = [[k, f"{v:8.0f}"] for k, v in table.items()]
    kind = "torch" if args.torch else "numpy"
    evicted = f", {C.fmt_size(args.evict)} copied before each call" if args.evict else ""
    print(C.format_table(["step", "ns/call"], rows, title=f"{C.fmt_size(count * 4)} float32 "
                         f"{kind}, 1 process{evicted}: commlib adds {total - raw:.0f} ns per allreduce"))
    print(f"timeline on: +{traced_added:.0f} ns per allreduce, median of {len(pairs)} "
          f"on-off pairs of loops of {calls} calls, its spill included (medians "
          f"{amortized['on']:.0f} on, {amortized['off']:.0f} off); at stop(): "
          f"{close_ns:.0f} ns per event to format the JSON (trace in {trace_dir}); off: "
          f"the stats' time accounting costs "
          f"{table['  accounting.timed (stats seconds; timeline off)']:.0f} ns, included in "
          f"every total")
    if args.cprofile:
        prof = cProfile.Profile()
        buf = np.zeros(count, np.float32)
        prof.runcall(lambda: [commlib.allreduce(buf) for _ in range(args.number)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    if args.json:
        C.write_json(args.json, {"benchmark": "profile_overhead", "kind": kind,
                                 "bytes": count * 4, "evict_bytes": args.evict, "ns_per_call": table,
                                 "timeline_added_ns": traced_added,
                                 "timeline_median_ns": amortized,
                                 "timeline_format_ns_per_event_at_stop": close_ns,
                                 "environment": C.environment(1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
