"""OSU-style micro-benchmark of commlib's collectives against raw mpi4py, in the same run.

    mpiexec -n 4 python benchmarks/bench_collectives.py [--ops allreduce,alltoall]
        [--min-size 8] [--max-size 64M] [--torch] [--shm] [--json PATH] [--plot PATH]

Per operation and size: a result check (commlib == mpi4py), a warm-up that sets the
iteration count, then ``--reps`` timed blocks of commlib and of the raw peer, alternating
(who goes first alternates too). A block's time is the slowest rank's mean time per call
after a barrier (OSU); latency is the median over blocks. The peer uses uppercase buffer
methods with prebuilt ``[buf, count, type]`` messages and preallocated outputs on its own
``COMM_WORLD.Dup()``, on the same memory commlib gets. Sizes are the buffer each rank
passes to commlib; algbw/busbw follow nccl-tests (see benchmarks/README.md).

``--shm``: commlib is timed twice, over MPI (``COMMLIB_SHM=0``: the ``commlib`` columns)
and through the shared-memory tier at every size (``COMMLIB_SHM=1``: ``shm``; see
:mod:`commlib.primitives.node_shm`), interleaved with the raw peer in the same blocks, and
rank 0 measures one core's memcpy and in-place add bandwidth on 64 MiB of the dtype in the
same run (the bound of a memory-bound tier), printed with the tables and kept in the JSON.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

OPS = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter", "alltoall",
       "pingpong")
DTYPES = {"float32": "FLOAT", "float64": "DOUBLE", "int32": "INT32_T", "int64": "INT64_T"}
TARGET_RATIO = 0.97      # commlib busbw / mpi4py busbw at sizes >= LARGE
TARGET_ADDED_US = 10.0   # commlib - mpi4py latency at the smallest size (8 B)
LARGE = 1 << 20
CHECK = {True: "ok", False: "FAIL", None: "-"}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests bus bandwidth factor (busbw = algbw x factor)."""
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("allgather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    return 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Benchmark commlib collectives against raw mpi4py (run under mpiexec).",
        epilog="Sizes accept binary units: 8, 512B, 4K, 1MiB, 64M. Results: a table on rank "
               "0, a JSON file and a PNG plot (default under benchmarks/results/).")
    p.add_argument("--ops", default=",".join(OPS),
                   help=f"comma-separated subset of {','.join(OPS)} (default: all)")
    p.add_argument("--min-size", type=C.parse_size, default=8, help="smallest size (8 B)")
    p.add_argument("--max-size", type=C.parse_size, default=64 << 20,
                   help="largest size (64 MiB)")
    p.add_argument("--sizes", type=C.parse_size, nargs="+", default=None,
                   help="these sizes only (instead of --min-size..--max-size)")
    p.add_argument("--factor", type=int, default=2, choices=(2, 4),
                   help="size step (x2 or x4; default 2)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="element type")
    p.add_argument("--torch", action="store_true",
                   help="pass CPU torch tensors to commlib (the peer uses numpy views)")
    p.add_argument("--warmup", type=int, default=10,
                   help="timed warm-up calls per implementation and size (default 10)")
    p.add_argument("--reps", type=int, default=11,
                   help="timed blocks per implementation and size; median taken (11)")
    p.add_argument("--block-ms", type=float, default=10.0,
                   help="target duration of one timed block, sets iterations (10 ms)")
    p.add_argument("--min-iters", type=int, default=1, help="iterations per block, at least")
    p.add_argument("--max-iters", type=int, default=1000, help="iterations per block, at most")
    p.add_argument("--fresh-output", action="store_true",
                   help="let commlib allocate a new result per call for allgather, "
                        "reduce_scatter and alltoall (default: out= a preallocated buffer, "
                        "as the raw peer does)")
    p.add_argument("--shm", action="store_true",
                   help="time commlib over MPI (COMMLIB_SHM=0) and through the shared-memory "
                        "tier (COMMLIB_SHM=1) side by side, and one core's memcpy bandwidth")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the commlib-vs-mpi4py result comparison")
    p.add_argument("--json", type=Path, help="JSON output (default benchmarks/results/...)")
    p.add_argument("--plot", type=Path, help="PNG plot (default: the JSON path, .png)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG plot")
    args = p.parse_args(argv)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in args.ops if o not in OPS]
    if bad or not args.ops:
        p.error(f"--ops: unknown {bad}; choose from {','.join(OPS)}")
    if args.min_size > args.max_size:
        p.error("--min-size is larger than --max-size")
    if min(args.reps, args.min_iters, args.max_iters) < 1 or args.warmup < 0:
        p.error("--reps and --*-iters must be >= 1, --warmup >= 0")
    return args


# -- buffers and cases -------------------------------------------------------------------
class Ctx:
    """The raw peer communicator and how to make buffers of the benchmarked kind."""

    def __init__(self, args: argparse.Namespace) -> None:
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()
        self.rank, self.n = self.comm.Get_rank(), self.comm.Get_size()
        self.dtype = np.dtype(args.dtype)
        self.mpitype = getattr(MPI, DTYPES[args.dtype])   # predefined, as commlib uses
        self.torch = args.torch
        self.fresh_output = args.fresh_output

    def buffer(self, count: int) -> tuple[Any, np.ndarray]:
        """(object handed to commlib, numpy view of the same memory)."""
        if self.torch:
            import torch
            t = torch.from_numpy(np.zeros(count, dtype=self.dtype))
            return t, t.numpy()
        a = np.zeros(count, dtype=self.dtype)
        return a, a

    def out(self, shape: tuple) -> tuple[Any, np.ndarray]:
        """(commlib's ``out=`` object or None with --fresh-output, raw peer's array)."""
        if self.torch:
            import torch
            t = torch.from_numpy(np.empty(shape, dtype=self.dtype))
            return (None if self.fresh_output else t), t.numpy()
        a = np.empty(shape, dtype=self.dtype)
        return (None if self.fresh_output else a), a

    def msg(self, arr: np.ndarray, count: int | None = None) -> list:
        return [arr, arr.size if count is None else count, self.mpitype]


@dataclass
class Case:
    lib: Callable[[], Any]       # one commlib call (or ping-pong round trip); returns result
    raw: Callable[[], Any]       # the same with raw mpi4py
    arr: np.ndarray              # input memory (filled for the check, zeroed for timing)
    count: int                   # elements per rank
    alg_scale: int = 1           # algbw bytes = input bytes x alg_scale (allgather: n)
    time_scale: float = 1.0      # ping-pong: one-way latency = round trip / 2


def case_allreduce(ctx: Ctx, count: int) -> Case:
    import commlib
    obj, arr = ctx.buffer(count)
    msg, IN_PLACE, SUM = ctx.msg(arr), ctx.MPI.IN_PLACE, ctx.MPI.SUM

    def raw() -> Any:
        ctx.comm.Allreduce(IN_PLACE, msg, SUM)
        return arr
    return Case(lambda: commlib.allreduce(obj), raw, arr, count)


def case_reduce(ctx: Ctx, count: int) -> Case:
    import commlib
    obj, arr = ctx.buffer(count)
    msg = ctx.msg(arr)
    send, recv = (ctx.MPI.IN_PLACE, msg) if ctx.rank == 0 else (msg, None)

    def raw() -> Any:
        ctx.comm.Reduce(send, recv, ctx.MPI.SUM, 0)
        return arr
    return Case(lambda: commlib.reduce(obj, dst=0), raw, arr, count)


def case_broadcast(ctx: Ctx, count: int) -> Case:
    import commlib
    obj, arr = ctx.buffer(count)
    msg = ctx.msg(arr)

    def raw() -> Any:
        ctx.comm.Bcast(msg, 0)
        return arr
    return Case(lambda: commlib.broadcast(obj, src=0), raw, arr, count)


def case_allgather(ctx: Ctx, count: int) -> Case:
    import commlib
    obj, arr = ctx.buffer(count)
    mine, out = ctx.out((ctx.n, count))
    send, recv = ctx.msg(arr), ctx.msg(out, count)

    def raw() -> Any:
        ctx.comm.Allgather(send, recv)
        return out
    return Case(lambda: commlib.allgather(obj, out=mine), raw, arr, count, alg_scale=ctx.n)


def case_reduce_scatter(ctx: Ctx, count: int) -> Case:
    import commlib
    obj, arr = ctx.buffer(count)
    counts = commlib.block_sizes(count, ctx.n)
    mine, out = ctx.out((counts[ctx.rank],))
    send, recv = ctx.msg(arr), ctx.msg(out)

    def raw() -> Any:
        ctx.comm.Reduce_scatter(send, recv, counts, ctx.MPI.SUM)
        return out
    return Case(lambda: commlib.reduce_scatter(obj, out=mine), raw, arr, count)


def elements(ctx: Ctx, op: str, nbytes: int) -> int:
    """Elements per rank for a nominal size (alltoall: whole elements for every rank)."""
    count = max(1, nbytes // ctx.dtype.itemsize)
    return -(-count // ctx.n) * ctx.n if op == "alltoall" else count


def case_alltoall(ctx: Ctx, count: int) -> Case:
    import commlib
    obj, arr = ctx.buffer(count)
    mine, out = ctx.out((count,))
    send, recv = ctx.msg(arr, count // ctx.n), ctx.msg(out, count // ctx.n)

    def raw() -> Any:
        ctx.comm.Alltoall(send, recv)
        return out
    return Case(lambda: commlib.alltoall(obj, out=mine), raw, arr, count)


def case_pingpong(ctx: Ctx, count: int) -> Case:
    """Ranks 0 and 1 bounce one buffer (send then recv / recv then send); others idle."""
    import commlib
    obj, arr = ctx.buffer(count)
    msg, c = ctx.msg(arr), ctx.comm
    peer = {0: 1, 1: 0}.get(ctx.rank)

    def lib() -> Any:
        if peer == 1:
            commlib.send(obj, 1)
            commlib.recv(obj, 1)
        elif peer == 0:
            commlib.recv(obj, 0)
            commlib.send(obj, 0)
        return arr

    def raw() -> Any:
        if peer == 1:
            c.Send(msg, 1)
            c.Recv(msg, 1)
        elif peer == 0:
            c.Recv(msg, 0)
            c.Send(msg, 0)
        return arr
    return Case(lib, raw, arr, count, time_scale=0.5)


CASES = {name: globals()[f"case_{name}"] for name in OPS}
#: The operations the shared-memory tier serves (``--shm``).
SHM_OPS = ("allreduce", "broadcast", "allgather", "reduce_scatter")


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


# -- reporting ---------------------------------------------------------------------------
def shm_table(op: str, recs: list[dict], bound: dict | None) -> str:
    """Raw MPI, commlib over MPI, the shared-memory tier (``--shm``) and the copy bound."""
    rows = [[C.fmt_size(r["bytes"]), C.fmt(r["mpi4py"]["median_us"]),
             C.fmt(r["commlib"]["median_us"]), C.fmt(r["shm"]["median_us"]),
             C.fmt(r["mpi4py"]["busbw_GBps"], 3), C.fmt(r["commlib"]["busbw_GBps"], 3),
             C.fmt(r["shm"]["busbw_GBps"], 3), C.fmt(r["shm_ratio"], 3),
             C.fmt(r["shm_best_ratio"], 3), CHECK[r["check"]]] for r in recs]
    heads = ["size", "mpi4py us", "commlib us", "shm us", "mpi4py busbw", "commlib busbw",
             "shm busbw", "shm/mpi4py", "best", "check"]
    cap = (f"; one core: memcpy {bound['memcpy_GBps']:.2f} GB/s, add in place "
           f"{bound['add_GBps']:.2f} GB/s ({C.fmt_size(bound['bytes'])})" if bound else "")
    return C.format_table(heads, rows, title=f"{op}: raw MPI, commlib over MPI "
                          f"(COMMLIB_SHM=0), shared-memory tier (COMMLIB_SHM=1); median "
                          f"latency, busbw in GB/s{cap}")


def op_table(op: str, recs: list[dict]) -> str:
    rows = [[C.fmt_size(r["bytes"]), r["iters"], C.fmt(r["commlib"]["median_us"]),
             C.fmt(r["mpi4py"]["median_us"]), C.fmt(r["added_us"]),
             C.fmt(r["commlib"]["busbw_GBps"], 3), C.fmt(r["mpi4py"]["busbw_GBps"], 3),
             C.fmt(r["busbw_ratio"], 3), C.fmt(r["best_ratio"], 3), CHECK[r["check"]]]
            for r in recs]
    heads = ["size", "iters", "commlib us", "mpi4py us", "added us", "commlib busbw",
             "mpi4py busbw", "ratio", "best", "check"]
    return C.format_table(heads, rows, title=f"{op}: median latency per call, busbw in GB/s; "
                          "ratio = commlib/mpi4py busbw (medians), best = same from the "
                          "fastest blocks")


def summarize_op(op: str, recs: list[dict], from_8b: bool) -> dict:
    """Targets of one op. PASS needs the median-based and the best-block-based statistic
    to agree, so that noise cannot pass a target; a MISS can still be noise. The latency
    target is only judged when the run starts at 8 B (``from_8b``)."""
    small = min(recs, key=lambda r: r["bytes"])
    large = [r for r in recs if r["bytes"] >= LARGE]
    worst_added = max(small["added_us"], small["best_added_us"])
    out = {"op": op, "small_bytes": small["bytes"], "added_us": small["added_us"],
           "best_added_us": small["best_added_us"],
           "latency": ("PASS" if worst_added <= TARGET_ADDED_US else "MISS") if from_8b
           else "n/a",
           "min_ratio": None, "min_ratio_bytes": None, "min_best_ratio": None,
           "geomean_ratio": None, "bandwidth": "n/a",
           "checks_ok": all(r["check"] is not False for r in recs)}
    if large:
        worst = min(large, key=lambda r: r["busbw_ratio"])
        out.update(min_ratio=worst["busbw_ratio"], min_ratio_bytes=worst["bytes"],
                   min_best_ratio=min(r["best_ratio"] for r in large),
                   geomean_ratio=C.geomean(r["busbw_ratio"] for r in large))
        low = min(out["min_ratio"], out["min_best_ratio"])
        out["bandwidth"] = "PASS" if low >= TARGET_RATIO else "MISS"
    return out


def summary_table(summary: list[dict]) -> str:
    rows = [[s["op"], C.fmt_size(s["small_bytes"]), C.fmt(s["added_us"]),
             C.fmt(s["best_added_us"]), s["latency"], C.fmt(s["min_ratio"], 3),
             C.fmt_size(s["min_ratio_bytes"]) if s["min_ratio_bytes"] else "-",
             C.fmt(s["min_best_ratio"], 3), C.fmt(s["geomean_ratio"], 3), s["bandwidth"],
             "ok" if s["checks_ok"] else "FAIL"] for s in summary]
    heads = ["op", "small", "added us", "best", f"<={TARGET_ADDED_US:g}us",
             "min ratio>=1MiB", "at", "best", "geomean", f">={TARGET_RATIO}x", "results"]
    return C.format_table(heads, rows, title="Targets (commlib vs raw mpi4py, same run; "
                          "PASS needs median and best blocks to agree)")


def plot(path: Path, results: dict[str, list[dict]], n: int, label: str) -> Path:
    metric = "busbw_GBps" if n > 1 else "algbw_GBps"
    panels = []
    for op, recs in results.items():
        x = [r["bytes"] for r in recs]
        panels.append({
            "title": op, "xlabel": "bytes per rank",
            "ylabel": metric.split("_")[0] + " (GB/s)",
            "series": {name: (x, [r[name][metric] for r in recs])
                       for name in ("commlib", "mpi4py", "shm") if name in recs[0]},
            "ratio": (x, [r["busbw_ratio"] for r in recs]), "ratio_label": "commlib/mpi4py"})
    return C.plot_panels(path, panels, f"commlib vs mpi4py, {label}", ref_ratio=TARGET_RATIO)


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import commlib
    commlib.init()
    ctx = Ctx(args)
    bound = None
    if args.shm:   # one core's copy bandwidth, alone, before and after the run
        ctx.comm.Barrier()
        before = copy_bound(ctx.dtype) if ctx.rank == 0 else None
        ctx.comm.Barrier()
    results = run(args, ctx)
    if args.shm:
        ctx.comm.Barrier()
        after = copy_bound(ctx.dtype) if ctx.rank == 0 else None
        ctx.comm.Barrier()
        if ctx.rank == 0:
            bound = {k: max(before[k], after[k]) for k in before}
            bound["before"], bound["after"] = before, after
    if ctx.rank != 0:
        return 0
    label = f"{ctx.n} ranks, {args.dtype}{', torch' if args.torch else ''}"
    for op, recs in results.items():
        print(op_table(op, recs), end="\n\n")
        if recs and "shm" in recs[0]:
            print(shm_table(op, recs, bound), end="\n\n")
    smallest = min(args.sizes) if args.sizes else args.min_size
    summary = [summarize_op(op, recs, smallest <= 8) for op, recs in results.items()]
    print(summary_table(summary))
    stem = (f"collectives_n{ctx.n}_{args.dtype}{'_torch' if args.torch else ''}"
            f"{'_shm' if args.shm else ''}")
    json_path = args.json or C.default_path(stem, ".json")
    data = {"benchmark": "collectives", "label": label, "method": __doc__,
            "environment": C.environment(ctx.n),
            "commlib": {"version": commlib.__version__, "path": commlib.__file__,
                        "options": commlib.options.as_dict()},
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "targets": {"ratio": TARGET_RATIO, "large_bytes": LARGE,
                        "added_us": TARGET_ADDED_US},
            "summary": summary, "results": results, "copy_bound": bound}
    print(f"\nJSON: {C.write_json(json_path, data)}")
    if not args.no_plot:
        png = plot(args.plot or Path(json_path).with_suffix(".png"), results, ctx.n, label)
        print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
