"""OSU-style micro-benchmark of commlib's collectives against raw mpi4py, in the same run.

    mpiexec -n 4 python benchmarks/bench_collectives.py [--ops allreduce,alltoall]
        [--min-size 8] [--max-size 64M] [--torch] [--shm] [--json PATH] [--plot PATH]

Per operation and size: a result check (commlib == mpi4py), a warm-up that sets the
iteration count, then ``--reps`` timed blocks of commlib and of the raw peer, alternating
(who goes first alternates too). A block's time is the slowest rank's mean time per call
after a barrier (OSU); latency is the median over blocks. The peer uses uppercase buffer
methods with prebuilt ``[buf, count, type]`` messages and preallocated outputs on its own
``COMM_WORLD.Dup()``, on the same memory commlib gets. Sizes are the buffer each rank
passes to commlib; algbw/busbw follow nccl-tests (see docs/benchmarks/collectives.md).

``--shm``: commlib is timed twice, over MPI (``COMMLIB_SHM=0``: the ``commlib`` columns)
and through the shared-memory tier at every size (``COMMLIB_SHM=1``: ``shm``; see
:mod:`commlib.primitives.node_shm`), interleaved with the raw peer in the same blocks, and
rank 0 measures one core's memcpy and in-place add bandwidth on 64 MiB of the dtype in the
same run (the bound of a memory-bound tier), printed with the tables and kept in the JSON.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from bench_collectives_cases import (  # noqa: E402, F401
    CASES,
    DTYPES,
    OPS,
    SHM_OPS,
    Case,
    Ctx,
    elements,
)
from bench_collectives_report import (  # noqa: E402, F401
    CHECK,
    LARGE,
    TARGET_ADDED_US,
    TARGET_RATIO,
    op_table,
    plot,
    shm_table,
    summarize_op,
    summary_table,
)
from bench_collectives_timing import (  # noqa: E402, F401
    bus_factor,
    check,
    copy_bound,
    measure,
    record,
    run,
    with_setting,
)


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
