"""The cost model past one machine: predicted step time and time to accuracy at 8-1024
ranks (cost_model.py's module doc, "Past one machine"), the recommendation (the least
predicted time to accuracy per bandwidth and scale) and its plot."""
from __future__ import annotations

import os
import statistics
from typing import Any

from cost_model_formulas import MODELLED, PEER, SYNC, Cluster, Tier, bytes_ratio, comm_time

SCALE = {"ranks_per_node": 8, "intra": Tier(3e-6, 8 / 1200e9), "inter_alpha": 10e-6,
         "inter_gbit": (10, 25, 100, 400), "ranks": (8, 16, 32, 64, 128, 256, 512, 1024),
         "model_bytes": 25.6e6 * 4, "compute_s": 0.20, "compress_gbyte_s": 200.0,
         "qadam_warm_fraction": 0.05}


# predicted at scale only: hierarchical=True of the compressed algorithms (full precision
# inside the node, compressed among node leaders, as Bagua does); steps to target as flat
SCALE_ONLY = ("bytegrad_hier", "qadam_hier")
# exchanged bucket by bucket during backward (or, decentralized, beside forward/backward)
OVERLAPPED = (SYNC, "gradient_allreduce_hier", "bytegrad", "qadam", "decentralized", PEER,
              "powersgd", *SCALE_ONLY)
#: the GPT workload (``--workload gpt``): benchmarks/gpt.py's "small" (what
#: bench_time_to_accuracy trains); its compute per step on a GPU is ASSUMED
GPT = {"params": 1049184, "compute_s": 0.01, "powersgd_ratio": 0.0448653429712996}


def steps_ratio(panels: dict[str, Any], model: str = "mlp") -> dict[str, float | None]:
    """Steps to target of each contender / synchronous training's, median over the runs of
    every shaped panel of ``model`` (None where it missed the target in most runs)."""
    ratios: dict[str, list[float | None]] = {}
    for panel in panels.values():
        if panel["model"] != model:
            continue
        for run in panel["runs"]:
            sync = run["contenders"][SYNC].get("steps_to_target")
            for name, row in run["contenders"].items():
                st = row.get("steps_to_target")
                ratios.setdefault(name, []).append(st / sync if st and sync else None)
    out: dict[str, float | None] = {}
    for name, vals in ratios.items():
        known = [v for v in vals if v is not None]
        out[name] = statistics.median(known) if len(known) * 2 > len(vals) else None
    return out


def contender_args(panels: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each contender's arguments (and PowerSGD's rank-implied ratio) as the runs used."""
    out: dict[str, dict[str, Any]] = {}
    for panel in panels.values():
        for name, row in panel["runs"][0]["contenders"].items():
            out.setdefault(name, {"kwargs": row.get("kwargs") or {},
                                  "psgd_ratio": row.get("design_bus_ratio"),
                                  "msg_ratio": row.get("message_ratio")})
    return out


def predict(ratios: dict[str, float | None], scale: dict[str, Any] | None = None,
            args: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    rows = []
    scale = SCALE if scale is None else scale
    args = args or {}
    s = scale["model_bytes"]
    compute = scale["compute_s"]
    compress = 1 / (scale["compress_gbyte_s"] * 1e9)
    for gbit in SCALE["inter_gbit"]:
        inter = Tier(SCALE["inter_alpha"], 8 / (gbit * 1e9))
        for n in SCALE["ranks"]:
            c = Cluster(n // SCALE["ranks_per_node"], SCALE["ranks_per_node"], SCALE["intra"],
                        inter)
            for name in MODELLED + SCALE_ONLY:
                a = args.get(name, {})
                psgd = a.get("psgd_ratio") or scale.get("powersgd_ratio")
                comm = comm_time(name, c, s, SCALE["qadam_warm_fraction"], compress,
                                 kwargs=a.get("kwargs"), psgd_ratio=psgd, compute_s=compute,
                                 msg_ratio=a.get("msg_ratio"))
                step = compute + comm
                if name in OVERLAPPED:   # exchanged while backward runs: half hides
                    step = compute + max(0.0, comm - 0.5 * compute)
                ratio = ratios.get(name.replace("_hier", "") if name in SCALE_ONLY else name)
                b = bytes_ratio(name.replace("_hier", ""), a.get("kwargs"), psgd, ranks=n,
                                msg_ratio=a.get("msg_ratio"))
                rows.append({"inter_gbit": gbit, "ranks": n, "contender": name,
                             "comm_s": comm, "step_s": step, "steps_ratio": ratio,
                             "bytes_per_step": None if b is None else b[0] * s,
                             "peak_bytes_per_step": None if b is None else b[1] * s,
                             "tta_sync_steps": None if ratio is None else step * ratio})
    # time to accuracy relative to flat gradient_allreduce at the same scale
    sync = {(r["inter_gbit"], r["ranks"]): r["tta_sync_steps"] for r in rows
            if r["contender"] == SYNC}
    for r in rows:
        base = sync[(r["inter_gbit"], r["ranks"])]
        r["tta_vs_sync"] = (None if r["tta_sync_steps"] is None or not base
                            else r["tta_sync_steps"] / base)
    return rows


def recommend(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (bandwidth, ranks): the contender with the least predicted time to accuracy."""
    best: dict[tuple[int, int], dict[str, Any]] = {}
    for r in rows:
        if r["tta_vs_sync"] is None or r["contender"] == PEER:
            continue
        k = (r["inter_gbit"], r["ranks"])
        if k not in best or r["tta_vs_sync"] < best[k]["tta_vs_sync"]:
            best[k] = r
    return [{"inter_gbit": g, "ranks": n, "best": r["contender"],
             "tta_vs_sync": r["tta_vs_sync"]} for (g, n), r in sorted(best.items())]


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = SCALE["inter_gbit"]
    fig, axes = plt.subplots(2, len(rates), figsize=(5.5 * len(rates), 8), squeeze=False)
    for j, gbit in enumerate(rates):
        for i, name in enumerate(MODELLED + SCALE_ONLY):
            pts = [r for r in rows if r["inter_gbit"] == gbit and r["contender"] == name]
            x = [r["ranks"] for r in pts]
            style = dict(marker="o", markersize=3, label=name, color=plt.cm.tab20(i),
                         linestyle="--" if name in SCALE_ONLY else "-")
            axes[0, j].plot(x, [r["step_s"] for r in pts], **style)
            tta = [(r["ranks"], r["tta_vs_sync"]) for r in pts if r["tta_vs_sync"] is not None]
            if tta:
                axes[1, j].plot(*zip(*tta), **style)
        axes[0, j].set(xscale="log", yscale="log", title=f"{gbit} Gbit/s between nodes",
                       xlabel="ranks (8 per node)", ylabel="predicted step time (s)")
        axes[1, j].set(xscale="log", xlabel="ranks (8 per node)",
                       ylabel="time to accuracy / gradient_allreduce's")
        for ax in axes[:, j]:
            ax.grid(True, which="both", alpha=0.3)
    axes[0, 0].legend(fontsize=6)
    fig.suptitle("cost model: ResNet-50-like (102 MB fp32, 0.2 s compute per step), "
                 "NVLink-class intra-node")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
