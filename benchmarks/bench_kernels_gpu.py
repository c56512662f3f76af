"""Throughput of the compression kernels on a GPU against a device-to-device copy.

For each size, a float32 torch CUDA tensor of that many bytes is compressed and
decompressed through the public API into preallocated outputs, and ``dst.copy_(x)``
copies the same bytes on the device (the yardstick). Each sample times a block of
``--iters`` calls between two ``torch.cuda.synchronize()`` (so whichever stream a kernel
runs on, its work is counted); operations are interleaved within every repetition and
the figure is the median. Throughput counts input (float32) bytes, as bench_kernels.py.

    python benchmarks/bench_kernels_gpu.py --sizes-mib 1 16 64 --json out.json
    NUMBA_ENABLE_CUDASIM=1 python benchmarks/bench_kernels_gpu.py --device cpu \\
        --sizes-mib 0.004 --reps 2 --iters 1        # exercises the code on the simulator
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from commlib import kernels

TARGET_RATIO = 0.5        # min-max quantizer and sign compressor vs copy, from 16 MiB on
TARGET_FROM_MIB = 16
TARGETED = ("quantize_minmax_uint8", "compress_sign")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 64])
    p.add_argument("--chunk-size", type=int, default=kernels.DEFAULT_CHUNK_SIZE)
    p.add_argument("--reps", type=int, default=11, help="timed samples per size")
    p.add_argument("--iters", type=int, default=10, help="calls per sample")
    p.add_argument("--warmup", type=int, default=2, help="untimed samples per size")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: torch CUDA tensors; cpu: numpy arrays through impl='cuda' "
                        "(with NUMBA_ENABLE_CUDASIM=1, a dry run of this script)")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def operations(x, chunk: int, device: str) -> dict[str, Callable[[], object]]:
    """The timed calls on input ``x`` (copy first: it is the yardstick)."""
    impl = "cuda"
    if device == "cuda":
        import torch
        dst, out, residual = torch.empty_like(x), torch.empty_like(x), torch.zeros_like(x)
        copy = lambda: dst.copy_(x)  # noqa: E731
    else:
        dst, out, residual = np.empty_like(x), np.empty_like(x), np.zeros_like(x)
        copy = lambda: np.copyto(dst, x)  # noqa: E731
    qbuf = kernels.quantize_minmax_uint8(x, chunk, impl=impl)
    sbuf = kernels.compress_sign(x, residual, chunk, impl=impl)
    qslot = qbuf.clone() if device == "cuda" else qbuf.copy()
    sslot = sbuf.clone() if device == "cuda" else sbuf.copy()
    return {
        "copy": copy,
        "quantize_minmax_uint8": lambda: kernels.quantize_minmax_uint8(x, chunk, out=qslot,
                                                                       impl=impl),
        "dequantize_minmax_uint8": lambda: kernels.dequantize_minmax_uint8(qbuf, out=out,
                                                                           impl=impl),
        "compress_sign": lambda: kernels.compress_sign(x, residual, chunk, out=sslot,
                                                       impl=impl),
        "decompress_sign": lambda: kernels.decompress_sign(sbuf, out=out, impl=impl),
    }


def measure(ops: dict[str, Callable[[], object]], sync: Callable[[], None], reps: int,
            iters: int, warmup: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in ops}
    for rep in range(warmup + reps):
        for name, op in ops.items():
            sync()
            start = time.perf_counter()
            for _ in range(iters):
                op()
            sync()
            if rep >= warmup:
                times[name].append((time.perf_counter() - start) / iters)
    return times


def check_same(x, chunk: int, device: str) -> dict[str, bool]:
    """The GPU results byte-identical (sign) or within one level (min-max) of the CPU
    twin's on this input: a throughput figure of a wrong kernel is worth nothing."""
    host = x.cpu().numpy() if device == "cuda" else x
    to_host = (lambda a: a.cpu().numpy()) if device == "cuda" else (lambda a: a)
    q_gpu = to_host(kernels.quantize_minmax_uint8(x, chunk, impl="cuda"))
    q_cpu = kernels.quantize_minmax_uint8(host, chunk, impl="cpu")
    r1, r2 = np.zeros_like(host), np.zeros_like(host)
    s_cpu = kernels.compress_sign(host, r1, chunk, impl="cpu")
    s_gpu = to_host(kernels.compress_sign(host, r2, chunk, impl="cuda"))
    return {"quantize_minmax_uint8": bool(np.abs(q_gpu.astype(np.int16)
                                                 - q_cpu.astype(np.int16)).max() <= 1),
            "compress_sign": bool(np.array_equal(s_gpu, s_cpu))}


def run(args: argparse.Namespace) -> dict:
    if args.device == "cuda":
        import torch
        sync, name = torch.cuda.synchronize, torch.cuda.get_device_name()
    else:
        sync, name = (lambda: None), "cpu (CUDA simulator)"
    rng = np.random.default_rng(0)
    results = []
    for mib in args.sizes_mib:
        numel = max(1, int(mib * 2**20) // 4)
        x = rng.standard_normal(numel, dtype=np.float32)
        if args.device == "cuda":
            import torch
            x = torch.from_numpy(x).cuda()
        ops = operations(x, args.chunk_size, args.device)
        times = measure(ops, sync, args.reps, args.iters, args.warmup)
        nbytes = numel * 4
        med = {k: float(np.median(v)) for k, v in times.items()}
        copy_gbps = nbytes / med["copy"] / 1e9
        stats = {k: {"median_s": med[k], "gbps": nbytes / med[k] / 1e9,
                     "ratio_vs_copy": (nbytes / med[k] / 1e9) / copy_gbps} for k in med}
        results.append({"size_mib": mib, "numel": numel, "ops": stats,
                        "matches_cpu": check_same(x, args.chunk_size, args.device)})
        print(f"{mib:g} MiB: copy {copy_gbps:.1f} GB/s", flush=True)
        for k, s in stats.items():
            if k != "copy":
                print(f"    {k:26s} {s['gbps']:8.1f} GB/s  {s['ratio_vs_copy']:5.2f}x copy",
                      flush=True)
    judged = [r for r in results if r["size_mib"] >= TARGET_FROM_MIB]
    # None: no size large enough to judge the target
    met = {k: (all(r["ops"][k]["ratio_vs_copy"] >= TARGET_RATIO for r in judged)
               if judged else None) for k in TARGETED}
    return {"device": name, "chunk_size": args.chunk_size, "reps": args.reps,
            "iters": args.iters, "target_ratio": TARGET_RATIO,
            "target_from_mib": TARGET_FROM_MIB, "target_met": met, "results": results}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    for k, ok in report["target_met"].items():
        print(f"{k}: >= {TARGET_RATIO}x copy from {TARGET_FROM_MIB} MiB on: "
              f"{'not judged' if ok is None else 'met' if ok else 'NOT met'}")
    wrong = [r["size_mib"] for r in report["results"] if not all(r["matches_cpu"].values())]
    if wrong:
        print(f"GPU kernels differ from their CPU twins at sizes {wrong} MiB")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
