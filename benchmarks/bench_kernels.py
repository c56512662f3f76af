"""Throughput of the CPU compression kernels against a plain memory copy.

For each size, a float32 input of that many bytes is compressed and decompressed
through the public API (allocation of the result included; decompression writes into a
preallocated ``out=``), and ``np.copyto`` copies the same input bytes into a
preallocated buffer. The operations are interleaved within every repetition, so a
machine that gets busier or quieter during the run affects all of them alike; the
reported figure is the median. Throughput is always counted in input (float32) bytes,
so a ratio of 1.0 means "as fast as copying the gradient once".

    python benchmarks/bench_kernels.py --sizes-mib 1 4 16 64 --reps 15
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np

from commlib import kernels

HERE = Path(__file__).resolve().parent
TARGET_RATIO = 0.5  # the CPU quantizer should reach half of memcpy bandwidth


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64],
                   help="input sizes in MiB of float32 (default: 1 4 16 64)")
    p.add_argument("--chunk-size", type=int, default=kernels.DEFAULT_CHUNK_SIZE)
    p.add_argument("--reps", type=int, default=15, help="timed repetitions per size")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions per size")
    p.add_argument("--threads", type=int, default=None,
                   help="Numba threads for the kernels (default: Numba's default)")
    p.add_argument("--json", type=Path, default=HERE / "results" / "bench_kernels.json")
    p.add_argument("--plot", type=Path, default=HERE / "results" / "bench_kernels.png")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def operations(x: np.ndarray, chunk: int) -> dict[str, Callable[[], object]]:
    """The timed calls for input ``x``; memcpy first, it is the yardstick."""
    copy_dst = np.empty_like(x)
    residual = np.zeros_like(x)
    out = np.empty_like(x)
    qbuf = kernels.quantize_minmax_uint8(x, chunk)
    sbuf = kernels.compress_sign(x, residual.copy(), chunk)
    qslot, sslot = np.empty_like(qbuf), np.empty_like(sbuf)
    return {
        "memcpy": lambda: np.copyto(copy_dst, x),
        # a new result buffer per call (allocation and first-touch page faults included)
        "quantize_minmax_uint8": lambda: kernels.quantize_minmax_uint8(x, chunk),
        # into a preallocated slot, as when filling an alltoall send buffer
        "quantize_minmax_uint8(out=)": lambda: kernels.quantize_minmax_uint8(x, chunk,
                                                                             out=qslot),
        "dequantize_minmax_uint8": lambda: kernels.dequantize_minmax_uint8(qbuf, out=out),
        "compress_sign": lambda: kernels.compress_sign(x, residual, chunk),
        "compress_sign(out=)": lambda: kernels.compress_sign(x, residual, chunk, out=sslot),
        "decompress_sign": lambda: kernels.decompress_sign(sbuf, out=out),
    }


def measure(ops: dict[str, Callable[[], object]], reps: int, warmup: int) -> dict:
    times: dict[str, list[float]] = {name: [] for name in ops}
    for rep in range(warmup + reps):
        for name, op in ops.items():
            start = time.perf_counter()
            op()
            elapsed = time.perf_counter() - start
            if rep >= warmup:
                times[name].append(elapsed)
    return times


def summarize(times: dict[str, list[float]], nbytes: int) -> dict:
    med = {name: float(np.median(t)) for name, t in times.items()}
    copy_gbps = nbytes / med["memcpy"] / 1e9
    # the best time is kept too: on a shared machine it shows what the code can do
    return {name: {"median_s": med[name], "gbps": nbytes / med[name] / 1e9,
                   "ratio_vs_memcpy": (nbytes / med[name] / 1e9) / copy_gbps,
                   "best_s": min(times[name]), "times_s": times[name]} for name in times}


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        numba.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    results = []
    for mib in args.sizes_mib:
        numel = int(mib * 2**20) // 4
        x = rng.standard_normal(numel, dtype=np.float32)
        ops = operations(x, args.chunk_size)
        stats = summarize(measure(ops, args.reps, args.warmup), x.nbytes)
        results.append({"size_mib": mib, "numel": numel, "ops": stats})
        print_row(mib, stats)
    return {
        "chunk_size": args.chunk_size, "reps": args.reps, "warmup": args.warmup,
        "numba_threads": numba.get_num_threads(), "threading_layer": _threading_layer(),
        "numba": numba.__version__, "numpy": np.__version__, "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "target_quantize_ratio": TARGET_RATIO, "results": results,
    }


def _threading_layer() -> str:
    try:
        return numba.threading_layer()
    except ValueError:  # no parallel function has run yet
        return "unknown"


def print_row(mib: float, stats: dict) -> None:
    print(f"{mib:g} MiB: memcpy {stats['memcpy']['gbps']:.2f} GB/s", flush=True)
    for name, s in stats.items():
        if name != "memcpy":
            print(f"    {name:30s} {s['gbps']:7.2f} GB/s  {s['ratio_vs_memcpy']:5.2f}x memcpy",
                  flush=True)


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["size_mib"] for r in report["results"]]
    names = list(report["results"][0]["ops"])
    fig, (ax_bw, ax_ratio) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, name in enumerate(names):
        style = dict(marker="o", color=f"C{i}", label=name)  # same colour in both panels
        ax_bw.plot(sizes, [r["ops"][name]["gbps"] for r in report["results"]], **style)
        if name != "memcpy":
            ax_ratio.plot(sizes, [r["ops"][name]["ratio_vs_memcpy"] for r in report["results"]],
                          **style)
    ax_ratio.axhline(report["target_quantize_ratio"], color="grey", ls="--",
                     label="quantizer target")
    for ax, ylabel in ((ax_bw, "GB/s of float32 input (median)"), (ax_ratio, "x memcpy")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("input size (MiB)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"commlib kernels, CPU, chunk {report['chunk_size']}, "
                 f"{report['numba_threads']} Numba threads")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    plot(report, args.plot)
    for name in ("quantize_minmax_uint8", "quantize_minmax_uint8(out=)"):
        worst = min(r["ops"][name]["ratio_vs_memcpy"] for r in report["results"])
        print(f"{name} vs memcpy: worst ratio {worst:.2f} (target >= {TARGET_RATIO})")
    print(f"wrote {args.json} and {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
