"""The cost model's Markdown: the step-time validation (error per run), the bytes check,
the recommendation on the emulated cluster (measured and predicted, each shape and rate,
10 Gbit/s predicted where it was not run) and at scale (``cost_model_scale.recommend``).
Every figure is computed from the runs' JSON; nothing is typed in."""
from __future__ import annotations

import statistics
from typing import Any

from cost_model_formulas import CONTROL, MODELLED, PEER, SYNC, Cluster, Tier
from cost_model_validate import cluster_of, model_bytes, row_comm

#: contenders that are exact synchronous training (not "relaxations") and the control
EXACT = (SYNC, "gradient_allreduce_hier", PEER, "torch_ddp_powersgd", CONTROL)


def _f(v: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def validation_markdown(checks: list[dict[str, Any]]) -> str:
    """Mean step time measured vs predicted from the unshaped run of the same shape: per
    panel and contender the median over seeds and each run's error."""
    if not checks:
        return "(no shaped panel has an unshaped run of its shape: no step-time validation)\n"
    lines = ["| panel | contender | measured ms | predicted ms | error % | error per run % "
             "(seeds) | comm ms |", "|---|---|---|---|---|---|---|"]
    for r in checks:
        per = ", ".join(f"{100 * e:+.1f} (s{s})" for e, s in
                        zip(r.get("error_per_run", []), r.get("seeds", [])))
        lines.append(f"| {r['panel']} | {r['contender']} | {_f(r['measured_s'], 1, 1e3)} | "
                     f"{_f(r['predicted_s'], 1, 1e3)} | {100 * r['error']:+.1f} | {per} | "
                     f"{_f(r['comm_s'], 1, 1e3)} |")
    runs = [e for r in checks for e in r.get("error_per_run", [r["error"]])]
    within = sum(abs(e) <= 0.2 for e in runs)
    lines.append(f"\nRuns within 20 %: {within}/{len(runs)}; median |error| over runs "
                 f"{100 * statistics.median(abs(e) for e in runs):.1f} %, largest "
                 f"{100 * max(abs(e) for e in runs):.1f} %.")
    return "\n".join(lines) + "\n"


def bytes_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| panel | contender | params | measured / sync | model / sync | error % |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        error = "-" if r["error"] is None else f"{100 * r['error']:+.1f}"
        lines.append(f"| {r['panel']} | {r['contender']} | {r['params']} | "
                     f"{_f(r['measured_ratio'], 4)} | {_f(r['model_ratio'], 4)} | {error} |")
    return "\n".join(lines) + "\n"


def _steps_to_target(panels: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per contender: its steps to target, median over every run of ``panels`` (None where
    it missed the target in most runs)."""
    vals: dict[str, list[float | None]] = {}
    for panel in panels:
        for run in panel["runs"]:
            for name, row in run["contenders"].items():
                vals.setdefault(name, []).append(row.get("steps_to_target"))
    out: dict[str, float | None] = {}
    for name, v in vals.items():
        known = [x for x in v if x is not None]
        out[name] = statistics.median(known) if len(known) * 2 > len(v) else None
    return out


def _cluster_at(panel_cluster: Cluster, ref: Cluster | None, mbit: float,
                efficiency: float) -> Cluster:
    """The emulated cluster at ``mbit`` between nodes: the inter-node latency of the
    shaped runs (``ref``), ``efficiency`` of the nominal rate (measured/nominal)."""
    alpha = (ref or panel_cluster).inter.alpha
    inter = Tier(alpha, 8 / (mbit * 1e6 * efficiency))
    return Cluster(panel_cluster.nodes, panel_cluster.per_node, panel_cluster.intra, inter)


def emulated_recommendation(shaped: dict[str, Any], unshaped: dict[str, Any],
                            base: dict[tuple[str, str], dict[str, float]],
                            extra_mbit: tuple[float, ...] = (10000.0,)
                            ) -> list[dict[str, Any]]:
    """Per (shape, rate) of the emulated cluster: the measured best (least median time to
    target among the relaxations, and its ratio to torch DDP) and the model's best
    (predicted step = calibrated base + communication at that rate, times the contender's
    measured steps to target at that shape, median over the shape's runs). Rates in
    ``extra_mbit`` that were not run are predicted only."""
    out = []
    by_shape: dict[tuple[str, str], list[tuple[str, dict[str, Any]]]] = {}
    for key, panel in shaped.items():
        shape = f"{panel['nodes']}x{panel['ranks_per_node']}"
        by_shape.setdefault((shape, panel["model"]), []).append((key, panel))
    for (shape, model), items in sorted(by_shape.items()):
        b = base.get((shape, model))
        steps = _steps_to_target([p for _, p in items])
        ref_panel = items[0][1]
        ref_run = ref_panel["runs"][0]
        ref = cluster_of(ref_panel, ref_run)
        eff = [p["runs"][0]["measured_inter_node"]["mbit"] / p["rate_mbit"] for _, p in items
               if isinstance(p["runs"][0].get("measured_inter_node"), dict)]
        efficiency = statistics.median(eff) if eff else 1.0
        rates = {float(p["rate_mbit"]): (key, p) for key, p in items}
        for mbit in sorted(set(rates) | set(extra_mbit), reverse=True):
            row: dict[str, Any] = {"shape": shape, "model": model, "rate_mbit": mbit,
                                   "measured": mbit in rates}
            if mbit in rates:
                key, panel = rates[mbit]
                s = panel["summary"]
                cands = [(r["time_to_target_s"], n) for n, r in s.items()
                         if not n.startswith("_") and n not in EXACT
                         and r["time_to_target_s"] is not None]
                if cands:
                    t, n = min(cands)
                    row.update(measured_best=n, measured_s=t,
                               measured_vs_peer=s[n].get("ttt_vs_torch_ddp"))
                peer_t = s.get(PEER, {}).get("time_to_target_s")
                row["measured_peer_s"] = peer_t
                c = cluster_of(panel, panel["runs"][0])
            else:
                c = _cluster_at(ref, ref, mbit, efficiency)
            if b is not None:
                s_bytes = model_bytes(ref_run)
                pred = {}
                for n in MODELLED:
                    if n not in b or steps.get(n) is None or n not in ref_run["contenders"]:
                        continue
                    step = b[n] + row_comm(n, c, s_bytes, ref_run["contenders"][n],
                                           b["_compute_s"])
                    pred[n] = step * steps[n]
                relax = {n: t for n, t in pred.items() if n not in EXACT}
                if relax:
                    n = min(relax, key=relax.get)
                    row.update(predicted_best=n, predicted_s=relax[n],
                               predicted_vs_peer=(relax[n] / pred[PEER]
                                                  if pred.get(PEER) else None))
                row["predicted_s_all"] = pred
            out.append(row)
    return out


def emulated_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| shape | Mbit/s | measured best relaxation | its s | x torch DDP | "
             "model's best | predicted s | predicted x torch DDP |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['rate_mbit']:g}{'' if r['measured'] else ' (not run)'} | "
            f"{r.get('measured_best', '-' if not r['measured'] else 'none reached')} | "
            f"{_f(r.get('measured_s'))} | {_f(r.get('measured_vs_peer'), 3)} | "
            f"{r.get('predicted_best', '-')} | {_f(r.get('predicted_s'))} | "
            f"{_f(r.get('predicted_vs_peer'), 3)} |")
    return "\n".join(lines) + "\n"


def scale_markdown(best: list[dict[str, Any]], scale: dict[str, Any]) -> str:
    ranks = sorted({b["ranks"] for b in best})
    gbits = sorted({b["inter_gbit"] for b in best})
    pick = {(b["inter_gbit"], b["ranks"]): b for b in best}
    lines = ["| Gbit/s between nodes | " + " | ".join(f"{n} ranks" for n in ranks) + " |",
             "|---|" + "---|" * len(ranks)]
    for g in gbits:
        cells = []
        for n in ranks:
            b = pick.get((g, n))
            cells.append("-" if b is None else f"{b['best']} ({b['tta_vs_sync']:.2f}x sync)")
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    lines.append(f"\nS = {scale['model_bytes'] / 1e6:.2f} MB fp32, "
                 f"{scale['compute_s'] * 1e3:.0f} ms compute per step (ASSUMED), "
                 f"{scale['ranks_per_node']} ranks per node; steps to target relative to "
                 f"synchronous training from the emulated runs.")
    return "\n".join(lines) + "\n"


def markdown(checks: list[dict[str, Any]], byte_checks: list[dict[str, Any]],
             emulated: list[dict[str, Any]], best: list[dict[str, Any]],
             scale: dict[str, Any]) -> str:
    return ("**Cost model validation** (mean step time of every shaped run, predicted from "
            "the unshaped run of its shape):\n\n" + validation_markdown(checks)
            + "\n**Bytes check** (steady bus bytes per sample / gradient_allreduce's):\n\n"
            + bytes_markdown(byte_checks)
            + "\n**Which algorithm, emulated cluster** (measured: least median time to "
              "target; model: calibrated step x measured steps to target):\n\n"
            + emulated_markdown(emulated)
            + "\n**Which algorithm at scale** (cost model, least predicted time to "
              "accuracy):\n\n" + scale_markdown(best, scale))
