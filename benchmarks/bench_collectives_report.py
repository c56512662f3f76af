"""The reports of bench_collectives: the text tables per operation (and of the
shared-memory tier), the targets (added latency at 8 B, the bandwidth ratio from 1 MiB on)
and the plot.
"""
from __future__ import annotations

from pathlib import Path

import _common as C

TARGET_RATIO = 0.97      # commlib busbw / mpi4py busbw at sizes >= LARGE
TARGET_ADDED_US = 10.0   # commlib - mpi4py latency at the smallest size (8 B)
LARGE = 1 << 20
CHECK = {True: "ok", False: "FAIL", None: "-"}


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
