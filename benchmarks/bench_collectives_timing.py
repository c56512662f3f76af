"""The timing of bench_collectives: the result check, the calibration, the interleaved
OSU-style blocks (commlib, the raw peer and, with ``--shm``, the shared-memory tier), one
core's copy bound, and the record of one (operation, size) with its bus bandwidth.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import _common as C
from bench_collectives_cases import CASES, SHM_OPS, Case, Ctx, elements


def bus_factor(op: str, n: int) -> float:
    """nccl-tests bus bandwidth factor (busbw = algbw x factor)."""
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("allgather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    return 1.0


# -- measurement -------------------------------------------------------------------------
def check(ctx: Ctx, case: Case, settings: tuple = (None,)) -> bool:
    """Run both implementations on rank-dependent data; True if every rank got equal
    results (raw MPI is the reference). ``settings``: the ``COMMLIB_SHM`` values commlib
    runs under (None: as it is)."""
    import commlib
    results = []
    saved = commlib.options.shm
    for setting, fn in [(s, case.lib) for s in settings] + [(None, case.raw)]:
        if setting is not None:
            commlib.options.shm = setting
        case.arr[...] = ctx.rank + 1
        out = fn()
        commlib.options.shm = saved
        results.append(np.array(out.numpy() if hasattr(out, "numpy") else out))   # a copy
    same = all(r.shape == results[-1].shape and np.array_equal(r, results[-1])
               for r in results[:-1])
    return bool(ctx.comm.allreduce(same, op=ctx.MPI.LAND))


def with_setting(fn: Callable[[], Any], setting: str | None) -> Callable[[], Any]:
    """``fn`` under ``COMMLIB_SHM=setting`` (for warm-up and calibration; timed blocks set
    the option once per block instead)."""
    if setting is None:
        return fn
    import commlib

    def call() -> Any:
        saved = commlib.options.shm
        commlib.options.shm = setting
        try:
            return fn()
        finally:
            commlib.options.shm = saved
    return call


def copy_bound(dtype: np.dtype, nbytes: int = 64 << 20, reps: int = 7) -> dict:
    """One core's memcpy (``np.copyto``) and in-place add (``np.add(a, b, out=a)``)
    bandwidth on ``nbytes`` of ``dtype``: bytes of the buffer per second, median of
    ``reps`` (after one untimed call each, so the pages are mapped)."""
    import time
    count = nbytes // dtype.itemsize
    a, b = np.ones(count, dtype), np.ones(count, dtype)
    out = {}
    for name, fn in (("memcpy", lambda: np.copyto(a, b)),
                     ("add", lambda: np.add(a, b, out=a))):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[f"{name}_GBps"] = C.gbps(count * dtype.itemsize, float(np.median(times)))
    out["bytes"] = count * dtype.itemsize
    return out


def measure(ctx: Ctx, op: str, count: int, args: argparse.Namespace) -> dict:
    import commlib
    case = CASES[op](ctx, count)
    shm = args.shm and op in SHM_OPS
    # name -> (COMMLIB_SHM while it runs, None: as set; the call)
    fns = {"commlib": ("0" if shm else None, case.lib), "mpi4py": (None, case.raw)}
    if shm:
        fns["shm"] = ("1", case.lib)
    ok = check(ctx, case, ("0", "1") if shm else (None,)) if args.check else None
    case.arr[...] = 0                   # stable values: SUM of zeros never overflows
    iters = C.calibrate(ctx.comm, [with_setting(f, s) for s, f in fns.values()], args.warmup,
                        args.block_ms / 1e3, args.min_iters, args.max_iters)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    snapshot: dict = {}
    order = list(fns)
    saved = commlib.options.shm
    for rep in range(args.reps):
        for name in (order if rep % 2 == 0 else order[::-1]):
            setting, fn = fns[name]
            if setting is not None:
                commlib.options.shm = setting
            commlib.stats(reset=True)
            samples[name].append(C.time_block(ctx.comm, fn, iters) * case.time_scale)
            commlib.options.shm = saved
            if name == "commlib":
                snapshot = commlib.stats(reset=True)
    return record(ctx, op, case, iters, samples, ok, C.per_call(snapshot, iters))


def record(ctx: Ctx, op: str, case: Case, iters: int, samples: dict, ok: bool | None,
           stats: dict) -> dict:
    nbytes = case.count * ctx.dtype.itemsize
    alg_bytes = nbytes * case.alg_scale
    factor = bus_factor(op, ctx.n)
    rec: dict[str, Any] = {"op": op, "bytes": nbytes, "count": case.count,
                           "alg_bytes": alg_bytes, "bus_factor": factor, "iters": iters,
                           "check": ok, "commlib_stats": stats}
    for name, s in samples.items():
        summary = C.summarize(s)
        algbw = C.gbps(alg_bytes, summary["median_us"] / 1e6)
        rec[name] = {**summary, "algbw_GBps": algbw, "busbw_GBps": algbw * factor}
    mine = stats.get(op)   # commlib's own count of bus bytes agrees with the formula?
    rec["stats_match"] = None if mine is None else bool(
        abs(mine["bus_bytes_per_call"] - alg_bytes * factor) <= 1)
    for stat, ratio, added in (("median_us", "busbw_ratio", "added_us"),
                               ("min_us", "best_ratio", "best_added_us")):
        lib, raw = rec["commlib"][stat], rec["mpi4py"][stat]
        rec[ratio] = raw / lib if lib > 0 else float("nan")   # same bytes: time ratio
        rec[added] = lib - raw
    if "shm" in rec:   # the shared-memory tier against raw MPI
        for stat, ratio in (("median_us", "shm_ratio"), ("min_us", "shm_best_ratio")):
            lib, raw = rec["shm"][stat], rec["mpi4py"][stat]
            rec[ratio] = raw / lib if lib > 0 else float("nan")
    return rec


def run(args: argparse.Namespace, ctx: Ctx) -> dict[str, list[dict]]:
    from tqdm import tqdm
    ops = [op for op in args.ops if op != "pingpong" or ctx.n >= 2]
    sizes = args.sizes or C.size_range(args.min_size, args.max_size, args.factor)
    results: dict[str, list[dict]] = {op: [] for op in ops}
    bar = tqdm(total=len(ops) * len(sizes), disable=ctx.rank != 0, file=sys.stderr,
               unit="case", dynamic_ncols=True,
               mininterval=0.5 if sys.stderr.isatty() else 30)   # quiet in log files
    for op in ops:
        counts = sorted({elements(ctx, op, nbytes) for nbytes in sizes})
        bar.update(len(sizes) - len(counts))
        for count in counts:
            bar.set_postfix_str(f"{op} {C.fmt_size(count * ctx.dtype.itemsize)}")
            results[op].append(measure(ctx, op, count, args))
            bar.update()
    bar.close()
    return results
