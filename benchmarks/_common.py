"""Helpers shared by commlib's benchmarks: sizes, timing, statistics, JSON, tables, plots.

Nothing here imports ``mpi4py.MPI`` at module level, so a benchmark's ``--help`` works
without ``mpiexec`` and without initializing MPI.

Timing method (OSU style): all ranks meet at a barrier, each rank times a loop of
``iters`` calls with ``time.perf_counter``, and the sample of that block is the largest
per-call time over the ranks (``max`` reduction). A measurement is the median of several
such blocks.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
          "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30,
          "gib": 1 << 30}
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# -- sizes -------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """``"8"``, ``"8B"``, ``"4K"``, ``"1MiB"``, ``"64M"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 8, 512B, 4K, 1MiB, 64M)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def fmt_size(nbytes: int) -> str:
    """Bytes as ``8 B``, ``4 KiB``, ``64 MiB`` (exact binary units where possible)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def size_range(lo: int, hi: int, factor: int = 2) -> list[int]:
    """Geometric sizes ``lo, lo*factor, ...`` up to ``hi`` (``hi`` itself always included)."""
    if lo < 1 or hi < lo or factor < 2:
        raise ValueError(f"bad size range {lo}..{hi} step x{factor}")
    sizes, s = [], lo
    while s < hi:
        sizes.append(s)
        s *= factor
    sizes.append(hi)
    return sizes


# -- timing ------------------------------------------------------------------------------
def polite_barrier(sync: Any, nap: float = 50e-6) -> None:
    """A barrier that sleeps while it waits instead of spinning in MPI's progress loop, so
    ranks that are done (or idle, like ranks >= 2 of a ping-pong) leave the CPU to the
    ranks still being timed; this matters when ranks outnumber cores."""
    request = sync.Ibarrier()
    while not request.Test():
        time.sleep(nap)


def time_block(sync: Any, fn: Callable[[], Any], iters: int) -> float:
    """Seconds per call of ``fn``: barrier, ``iters`` timed calls on every rank, max over
    ranks (the slowest rank defines the collective's time, as in the OSU benchmarks)."""
    from mpi4py import MPI
    sync.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    per_call = (time.perf_counter() - t0) / iters
    polite_barrier(sync)
    return sync.allreduce(per_call, op=MPI.MAX)


def calibrate(sync: Any, fns: Sequence[Callable[[], Any]], warmup: int, target_s: float,
              lo: int, hi: int) -> int:
    """Warm every ``fn`` up (one untimed call, one timed call, then ``warmup`` calls timed
    in three short blocks) and return the iteration count whose timed block lasts about
    ``target_s`` for the slowest of them, clamped to ``[lo, hi]``. Each ``fn`` counts its
    fastest block, so one noisy block does not shrink the count; a call that alone lasts
    ``target_s`` is warm enough (large messages skip the rest). All ranks agree."""
    per_call, chunk = 0.0, max(1, warmup // 3)
    for fn in fns:
        fn()
        first = time_block(sync, fn, 1)
        if first < target_s:
            first = min([first] + [time_block(sync, fn, chunk) for _ in range(3)])
        per_call = max(per_call, first)
    return max(lo, min(hi, math.ceil(target_s / max(per_call, 1e-9))))


def step_times(step: Callable[[], Any], warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` timed calls of ``step`` on this rank, after ``warmup``
    untimed ones (training-step benchmarks: one call is one step)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def torch_schedule_step(sched: Any, rank: int, stages: int, inputs: Any,
                        targets: Any) -> None:
    """One ``step`` of a ``torch.distributed.pipelining`` schedule on this rank: the first
    stage feeds ``inputs``, the last takes ``targets``, the others neither."""
    if rank == 0:
        sched.step(inputs)
    elif rank == stages - 1:
        sched.step(target=targets)
    else:
        sched.step()


def summarize(samples: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of per-call times in seconds, and the samples, in microseconds."""
    us = [s * 1e6 for s in samples]
    return {"median_us": statistics.median(us), "min_us": min(us), "max_us": max(us),
            "samples_us": us}


def per_call(snapshot: dict[str, dict[str, int]], iters: int) -> dict[str, dict[str, float]]:
    """A ``commlib.stats()`` snapshot of one timed block of ``iters`` iterations, per call:
    what this rank handed to MPI (``bytes``) and put on the wire (``bus_bytes``)."""
    return {op: {"calls_per_iter": v["calls"] / iters,
                 "bytes_per_call": v["bytes"] / max(v["calls"], 1),
                 "bus_bytes_per_call": v["bus_bytes"] / max(v["calls"], 1)}
            for op, v in snapshot.items()}


def gbps(nbytes: float, seconds: float) -> float:
    """Bandwidth in GB/s (10^9 bytes per second, the nccl-tests and OSU unit)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def geomean(values: Iterable[float]) -> float:
    vals = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else float("nan")


# -- run metadata and JSON ---------------------------------------------------------------
def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(nranks: int) -> dict[str, Any]:
    """Where and with what a benchmark ran (versions, MPI library, oversubscription)."""
    import mpi4py
    import numpy
    from mpi4py import MPI
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("COMMLIB_", "MPIR_CVAR_", "OMP_NUM_THREADS"))}
    return {
        "timestamp": _dt.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(), "platform": platform.platform(),
        "python": sys.version.split()[0], "numpy": numpy.__version__,
        "mpi4py": mpi4py.__version__,
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "ranks": nranks, "cpu_count": os.cpu_count(),
        "oversubscribed": nranks > (os.cpu_count() or nranks),
        "git_commit": _git_commit(), "argv": sys.argv, "env": env,
    }


def default_path(stem: str, suffix: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return RESULTS_DIR / f"{stem}_{stamp}{suffix}"


def write_json(path: str | os.PathLike, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=_jsonable) + "\n")
    return path


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


# -- text output -------------------------------------------------------------------------
def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
                 title: str | None = None) -> str:
    """A table as text: ``rich`` when it is installed, else plain right-aligned columns."""
    cells = [[str(c) for c in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
        lines = [title] if title else []
        lines.append("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
        return "\n".join(lines)
    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="right")
    for r in cells:
        table.add_row(*r)
    console = Console(width=200)
    with console.capture() as cap:
        console.print(table)
    return cap.get().rstrip("\n")


def fmt(value: float, digits: int = 2) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


# -- plots -------------------------------------------------------------------------------
def plot_panels(path: str | os.PathLike, panels: Sequence[dict[str, Any]], title: str,
                ref_ratio: float | None = None, cols: int = 4) -> Path:
    """One column per panel: a log-log plot of ``series`` (label -> (x, y)) over a linear
    plot of ``ratio`` ((x, y)), with a dashed line at ``ref_ratio``. Agg backend, PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = math.ceil(len(panels) / cols)
    ncols = min(cols, len(panels))
    fig = plt.figure(figsize=(4.6 * ncols, 5.2 * rows), constrained_layout=True)
    grid = fig.add_gridspec(2 * rows, ncols, height_ratios=[3, 1] * rows)
    for i, p in enumerate(panels):
        r, c = divmod(i, cols)
        top = fig.add_subplot(grid[2 * r, c])
        bottom = fig.add_subplot(grid[2 * r + 1, c], sharex=top)
        for label, (x, y) in p["series"].items():
            top.plot(x, y, marker="o", markersize=3, label=label)
        top.set(xscale="log", yscale="log", title=p["title"], ylabel=p["ylabel"])
        top.grid(True, which="both", alpha=0.3)
        top.legend(fontsize="small")
        x, y = p["ratio"]
        bottom.plot(x, y, marker="o", markersize=3, color="tab:green")
        if ref_ratio is not None:
            bottom.axhline(ref_ratio, color="tab:red", linestyle="--", linewidth=1)
            bottom.text(0.01, 0.04, f"target {ref_ratio:g}", color="tab:red",
                        transform=bottom.transAxes, fontsize="x-small")
        bottom.axhline(1.0, color="gray", linewidth=0.8)
        bottom.set(xscale="log", xlabel=p["xlabel"], ylabel=p["ratio_label"])
        bottom.grid(True, which="both", alpha=0.3)
    fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
