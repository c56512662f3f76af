"""The summaries of ``benchmarks/results/*.json`` files the benchmarks directive shows, one
per result schema.
"""
from __future__ import annotations

import os
import subprocess
from typing import Any

from .rst import _list_table


def _fmt(x: Any, digits: int = 3, none: str = "-") -> str:
    if x is None:
        return none
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e6:
        return str(int(x))
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _env_line(env: dict[str, Any]) -> str:
    parts = []
    for key in ("timestamp", "host", "mpi_library", "ranks", "cpu_count", "git_commit"):
        if key in env:
            value = str(env[key]).split("\n")[0]
            parts.append(f"{key} ``{value[:60]}``")
    return ", ".join(parts)


def _summarise_collectives(data: dict) -> str:
    env = data.get("environment", {})
    text = f"{data.get('label', '')}. {_env_line(env)}.\n\n"
    argv = env.get("argv")
    if argv:
        text += f"Made by::\n\n    mpiexec -n {env.get('ranks', 'N')} python {' '.join(argv)}\n\n"
    rows = [[r.get("op"), _fmt(r.get("added_us")), _fmt(r.get("geomean_ratio")),
             _fmt(r.get("min_ratio")), _fmt(r.get("min_ratio_bytes")), r.get("latency"),
             r.get("bandwidth")] for r in data.get("summary", [])]
    text += _list_table(["operation", "added latency (us, 8 B)", "geomean commlib/MPI bandwidth",
                         "worst ratio", "at bytes", "latency target", "bandwidth target"], rows)
    return text


def _summarise_tta(data: dict) -> str:
    cfg = data.get("config", {})
    text = (f"Time to accuracy, model ``{cfg.get('gpt_size', cfg.get('model', '?'))}``, "
            f"{cfg.get('epochs', '?')} epochs, batch {cfg.get('batch', '?')} per rank. "
            f"Target: {data.get('target_rule', '?')}.\n\n")
    if data.get("combined_from"):
        text += f"Combined from {len(data['combined_from'])} runs (seeds and shapes).\n\n"
    for panel, p in data.get("panels", {}).items():
        summary = p.get("summary", {})
        rows = []
        for name, s in summary.items():
            if name.startswith("_") or not isinstance(s, dict):
                continue
            rows.append([f"``{name}``", _fmt(s.get("time_to_target_s"), none="not reached"),
                         _fmt(s.get("ttt_vs_torch_ddp")), _fmt(s.get("bus_ratio_vs_sync")),
                         _fmt(s.get("final_acc_worst"), 4), _fmt(s.get("samples_per_s"))])
        if rows:
            text += f"**{panel}** ({p.get('nodes', '?')} nodes x {p.get('ranks_per_node', '?')} " \
                    f"ranks, {_fmt(p.get('rate_mbit'))} Mbit/s between nodes; 0: unshaped)\n\n"
            text += _list_table(["contender", "time to target (s)", "vs torch DDP",
                                 "bus bytes vs sync",
                                 "final accuracy, worst replica (GPT: minus the loss)",
                                 "samples/s"], rows)
            text += "\n"
    return text


def _summarise_partition(data: dict) -> str:
    text = (f"``bench_partition``: GPT with {data.get('layers')} layers, context "
            f"{data.get('context')}, micro-batch {data.get('batch')}, {data.get('ranks')} ranks, "
            f"{data.get('mpi', '').strip()}. {data.get('note', '')}.\n\n")
    rows = []
    for step in data.get("steps", []):
        times = step.get("step_s", {})
        auto = times.get("auto")
        for name, t in times.items():
            ratio = _fmt(t / auto) if auto else "-"
            rows.append([str(step.get("stages")), str(step.get("micro_batches")), name,
                         _fmt(t * 1e3), ratio])
    text += _list_table(["stages", "micro-batches", "cut", "1F1B step (ms)", "vs auto"], rows)
    return text


def _summarise_cost_model(data: dict) -> str:
    text = (f"The cost model calibrated on the ``{data.get('workload')}`` workload; "
            f"{len(data.get('validation', []))} step times validated against measurements. "
            "The algorithm it predicts fastest to the target, by link speed and ranks:\n\n")
    by_rate: dict[Any, list[str]] = {}
    ranks: list[Any] = []
    for rec in data.get("recommendation", []):
        by_rate.setdefault(rec["inter_gbit"], []).append(
            f"{rec['best']} ({_fmt(rec['tta_vs_sync'], 2)})")
        if rec["ranks"] not in ranks:
            ranks.append(rec["ranks"])
    rows = [[f"{g} Gbit/s", *cells] for g, cells in by_rate.items()]
    if rows:
        text += _list_table(["link", *[f"{r} ranks" for r in ranks]], rows)
    return text


def _summarise_grid(data: dict) -> str:
    text = (f"Progress file of the time-to-accuracy grid: {len(data.get('done', []))} jobs "
            f"done, {len(data.get('skipped', []))} skipped, {len(data.get('failed', []))} "
            f"failed, in {data.get('pieces')} pieces ({_fmt(data.get('grid_s'))} s of a "
            f"{_fmt(data.get('budget_s'))} s budget).\n")
    return text


_MADE_BY = {
    "collectives": "benchmarks/bench_collectives.py",
    "partition": "benchmarks/bench_partition.py --json",
    "tta": "benchmarks/bench_time_to_accuracy.py --json (the GPT grid: benchmarks/run_tta_gpt.sh)",
    "cost_model": "benchmarks/bench_time_to_accuracy_grid.py (the cost model calibrated on the "
                  "grid's runs: benchmarks/cost_model.py)",
    "grid": "benchmarks/run_tta_gpt.sh (benchmarks/bench_time_to_accuracy_grid.py)",
}


def _kind(data: Any) -> str | None:
    if not isinstance(data, dict):
        return None
    if data.get("benchmark") == "collectives":
        return "collectives"
    if data.get("benchmark") == "bench_partition":
        return "partition"
    if "panels" in data and "target_rule" in data:
        return "tta"
    if "recommendation" in data and "validation" in data:
        return "cost_model"
    if {"done", "skipped", "failed"} <= set(data):
        return "grid"
    return None


def _committed(path: str) -> str:
    """The date and commit of the file's last change (``git log``), or ''."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%cs %h", "--", path],
                             capture_output=True, text=True, timeout=20,
                             cwd=os.path.dirname(path)).stdout.strip()
    except Exception:
        return ""
    return out


def _summarise(data: Any) -> str | None:
    if not isinstance(data, dict):
        return None
    if data.get("benchmark") == "collectives":
        return _summarise_collectives(data)
    if data.get("benchmark") == "bench_partition":
        return _summarise_partition(data)
    if "panels" in data and "target_rule" in data:
        return _summarise_tta(data)
    if "recommendation" in data and "validation" in data:
        return _summarise_cost_model(data)
    if {"done", "skipped", "failed"} <= set(data):
        return _summarise_grid(data)
    return None
