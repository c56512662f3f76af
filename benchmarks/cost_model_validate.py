"""The cost model against the emulated runs: the panels of bench_time_to_accuracy JSON
files, calibration on the unshaped runs, validation of the step time on the shaped ones
and of the byte terms on every shaped run (cost_model.py's module doc)."""
from __future__ import annotations

import json
import os
import statistics
from typing import Any

from cost_model_formulas import (
    CONTROL,
    MODELLED,
    SYNC,
    Cluster,
    Tier,
    bytes_ratio,
    comm_time,
    tier_of,
)


def _load(paths: list[str], shaped: bool) -> dict[str, Any]:
    """The panels of ``paths`` whose links were rate-limited (``shaped``) or not."""
    panels: dict[str, Any] = {}
    for path in paths:
        with open(path) as fh:
            for key, panel in json.load(fh)["panels"].items():
                if key in panels:  # the same shape in two files: keep both
                    key = f"{key} ({os.path.basename(path)})"
                panels[key] = panel
    return {k: p for k, p in panels.items() if bool(p["rate_mbit"]) == shaped}


def cluster_of(panel: dict[str, Any], run: dict[str, Any]) -> Cluster:
    default = Tier(alpha=20e-6, beta=8 / 20e9)
    inter = tier_of(run.get("measured_inter_node"), default)
    intra = tier_of(run.get("measured_intra_node"), inter)
    return Cluster(panel["nodes"], panel["ranks_per_node"], intra, inter)


def model_bytes(run: dict[str, Any]) -> float:
    return 4.0 * next(iter(run["contenders"].values()))["params"]


def warm_fraction(row: dict[str, Any]) -> float:
    kw = row.get("kwargs", {})
    if row.get("algorithm") == "async_model_average":
        return min(1.0, kw.get("warmup_steps", 0) / row["steps"])
    if row.get("algorithm") == "qadam":
        return min(1.0, kw.get("warmup_steps", 0) / row["steps"])
    if row.get("algorithm") == "powersgd":
        start = kw.get("start_iter", 0)
        start = row.get("steps_per_epoch", 0) if start == "epoch" else start
        return min(1.0, start / row["steps"])
    return 0.0


def row_comm(name: str, c: Cluster, s: float, row: dict[str, Any],
             compute_s: float = 0.0) -> float:
    """``comm_time`` with a run's contender row: its arguments, warm-up, PowerSGD ratio;
    ``compute_s`` per step hides the exchanges that overlap the next steps."""
    return comm_time(name, c, s, warm_fraction(row), kwargs=row.get("kwargs"),
                     psgd_ratio=row.get("design_bus_ratio"), compute_s=compute_s,
                     msg_ratio=row.get("message_ratio"))


def compute_of(means: dict[str, float]) -> float:
    """Compute seconds per step on a cluster: the control's mean step (no communication),
    else the least mean step of the panel."""
    return means.get(CONTROL, min(means.values()))


def validate_bytes(panels: dict[str, Any]) -> list[dict[str, Any]]:
    """Every shaped run: steady bus bytes per sample / gradient_allreduce's, measured
    (median over seeds) against ``bytes_ratio``."""
    rows = []
    for key, panel in panels.items():
        runs = panel["runs"]
        names = runs[0]["contenders"]
        if SYNC not in names:
            continue
        for name in names:
            row = runs[0]["contenders"][name]
            model = bytes_ratio(name, row.get("kwargs"), row.get("design_bus_ratio"),
                                ranks=panel["nodes"] * panel["ranks_per_node"],
                                msg_ratio=row.get("message_ratio"))
            if model is None or name == SYNC or not row.get("bytes_counted", True):
                continue
            warm = (row.get("kwargs") or {}).get("warmup_steps")
            if isinstance(warm, int) and warm >= row["steps"]:   # no steady phase ran
                continue
            measured = statistics.median(
                r["contenders"][name]["steady_bus_bytes_per_sample"]
                / r["contenders"][SYNC]["steady_bus_bytes_per_sample"] for r in runs)
            rows.append({"panel": key, "contender": name, "measured_ratio": measured,
                         "model_ratio": model[0], "peak_ratio": model[1],
                         "error": model[0] / measured - 1 if measured else None,
                         "params": row["params"]})
    return rows


def panel_means(panel: dict[str, Any]) -> dict[str, float]:
    """Median over seeds of each contender's mean step time."""
    names = panel["runs"][0]["contenders"]
    return {n: statistics.median(r["contenders"][n]["mean_step_s"] for r in panel["runs"])
            for n in names}


def calibrate(panels: dict[str, Any]) -> dict[tuple[str, str], dict[str, float]]:
    """(shape, model) -> contender -> base seconds (unshaped mean step minus the formula's
    communication on the unshaped links), and ``"_compute_s"``: the compute per step that
    overlapped exchanges hide (``compute_of``)."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for key, panel in panels.items():
        run = panel["runs"][0]
        c, s = cluster_of(panel, run), model_bytes(run)
        means = panel_means(panel)
        shape = f"{panel['nodes']}x{panel['ranks_per_node']}"
        compute = compute_of(means)
        base = {n: means[n] - row_comm(n, c, s, run["contenders"][n], compute)
                for n in means if n in MODELLED or n == CONTROL}
        out[(shape, panel["model"])] = {**base, "_compute_s": compute}
    return out


def validate(panels: dict[str, Any], base: dict[tuple[str, str], dict[str, float]]
             ) -> list[dict[str, Any]]:
    rows = []
    for key, panel in panels.items():
        shape = f"{panel['nodes']}x{panel['ranks_per_node']}"
        b = base.get((shape, panel["model"]))
        if b is None:
            continue
        run = panel["runs"][0]
        c, s = cluster_of(panel, run), model_bytes(run)
        means = panel_means(panel)
        for name in MODELLED:
            if name not in means or name not in b:
                continue
            comm = row_comm(name, c, s, run["contenders"][name], b["_compute_s"])
            predicted = b[name] + comm
            per_run = [predicted / r["contenders"][name]["mean_step_s"] - 1
                       for r in panel["runs"]]
            rows.append({"panel": key, "contender": name, "measured_s": means[name],
                         "predicted_s": predicted,
                         "error": predicted / means[name] - 1,
                         "seeds": [r.get("seed") for r in panel["runs"]],
                         "error_per_run": per_run,
                         "compute_only_s": b.get(CONTROL),
                         "comm_s": comm})
    return rows
