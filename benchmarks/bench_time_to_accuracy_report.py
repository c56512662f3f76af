"""Scoring and rendering of bench_time_to_accuracy's results: the target and each
contender's time to it, medians over seeds, the text and Markdown tables and the plot of
the score (accuracy, or the GPT's validation loss) against wall time."""
from __future__ import annotations

import math
import os
import statistics
from typing import Any

import _common as C
from bench_time_to_accuracy_contenders import CONTROL, PEER, PEERS, SYNC, design


def time_to(curve: list[dict[str, Any]], target: float) -> float | None:
    """Wall time of the first evaluation whose worst replica is at or above ``target``."""
    for point in curve:
        if point["acc_worst"] >= target - 1e-12:
            return point["wall_s"]
    return None


def steady_bus_per_sample(r: dict[str, Any]) -> float:
    """Wire bytes per sample after the first epoch (qadam's warm-up is one epoch), or
    after the contender's own ``warmup_steps`` where they are longer."""
    curve = r["curve"]
    warm = (r.get("kwargs") or {}).get("warmup_steps")
    first = max(r["steps_per_epoch"], warm if isinstance(warm, int) else 0)
    start = next((p for p in curve if p["step"] >= first), curve[0])
    end = curve[-1]
    samples = end["samples_rank0"] - start["samples_rank0"]
    return (end["bus_bytes_rank0"] - start["bus_bytes_rank0"]) / samples if samples else 0.0


def score(run: dict[str, Any], tolerance: float, loss_tolerance: float = 0.01) -> None:
    """Add the target and each contender's time to it (in place). Classifiers: the
    synchronous final accuracy minus ``tolerance``; the GPT (scored as minus the validation
    loss): the synchronous final validation loss times ``1 + loss_tolerance``."""
    rows = run["contenders"]
    sync = rows.get(SYNC)
    if sync is None:
        target = None
    elif sync.get("metric") == "val_loss":
        target = sync["final_acc_worst"] * (1 + loss_tolerance)
    else:
        target = sync["final_acc_worst"] - tolerance
    run["target_acc"] = target
    peer_t = None
    if PEER in rows and target is not None:
        peer_t = time_to(rows[PEER]["curve"], target)
    sync_bus = None if sync is None else steady_bus_per_sample(sync)
    for name, r in rows.items():
        r["time_to_target_s"] = None if target is None else time_to(r["curve"], target)
        r["steps_to_target"] = next((p["step"] for p in r["curve"]
                                     if target is not None and p["wall_s"] ==
                                     r["time_to_target_s"]), None)
        t = r["time_to_target_s"]
        r["ttt_vs_torch_ddp"] = t / peer_t if t is not None and peer_t else None
        r["steady_bus_bytes_per_sample"] = steady_bus_per_sample(r)
        r["bus_ratio_vs_sync"] = (r["steady_bus_bytes_per_sample"] / sync_bus
                                  if sync_bus else None)
        design_ratio = design(name, r.get("kwargs")) or r.get("design_bus_ratio")
        r["bus_vs_design"] = (r["bus_ratio_vs_sync"] / design_ratio
                              if design_ratio and r["bus_ratio_vs_sync"] is not None else None)
        if sync is not None and sync.get("metric") == "val_loss":   # loss above sync's, %
            r["final_acc_gap_pp"] = 100 * (sync["final_acc_worst"] - r["final_acc_worst"]) \
                / -sync["final_acc_worst"]
        elif sync is not None:
            r["final_acc_gap_pp"] = 100 * (r["final_acc_worst"] - sync["final_acc_worst"])


def _median(values: list[float | None]) -> float | None:
    """Median of the values; ``None`` when any is ``None`` and they are not a majority
    (a contender that missed the target in most seeds has no median time)."""
    known = [v for v in values if v is not None]
    if len(known) * 2 <= len(values) and len(known) < len(values):
        return None
    return statistics.median(known) if known else None


SUMMARY_FIELDS = ("time_to_target_s", "ttt_vs_torch_ddp", "final_acc_worst",
                  "final_acc_mean", "final_acc_gap_pp", "samples_per_s", "bytes_per_sample",
                  "bus_bytes_per_sample", "steady_bus_bytes_per_sample", "bus_ratio_vs_sync",
                  "mean_step_s", "median_step_s", "steps_to_target", "wall_s",
                  "bus_vs_design")


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over seeds per contender, and in how many seeds it reached the target."""
    out: dict[str, Any] = {}
    for name in runs[0]["contenders"]:
        rows = [r["contenders"][name] for r in runs]
        row = {f: _median([x.get(f) for x in rows]) for f in SUMMARY_FIELDS}
        row["reached"] = sum(x["time_to_target_s"] is not None for x in rows)
        row["seeds"] = len(rows)
        out[name] = row
    out["_target_acc"] = statistics.median(r["target_acc"] for r in runs)
    return out


def _fmt(v: Any, digits: int = 2, scale: float = 1.0) -> str:
    return "None" if v is None else f"{v * scale:.{digits}f}"


def _final(panel: dict[str, Any], value: float | None) -> str:
    """The final score as printed: accuracy, or the GPT's validation loss (and perplexity)."""
    if value is None or panel.get("model") != "gpt":
        return _fmt(value, 4)
    return f"{-value:.4f} (ppl {math.exp(-value):.2f})"


def table(panel: dict[str, Any]) -> str:
    s = panel["summary"]
    gpt_panel = panel.get("model") == "gpt"
    headers = ["contender", "reached", "t->target s", "x torch",
               "final val loss worst" if gpt_panel else "final worst",
               "gap" if gpt_panel else "gap pp", "samples/s", "bus B/sample", "x sync bus",
               "x design", "mean step ms", "median step ms"]
    rows = []
    for name, r in s.items():
        if name.startswith("_"):
            continue
        rows.append([name, f"{r['reached']}/{r['seeds']}", _fmt(r["time_to_target_s"]),
                     _fmt(r["ttt_vs_torch_ddp"], 3), _final(panel, r["final_acc_worst"]),
                     _fmt(r["final_acc_gap_pp"], 1), _fmt(r["samples_per_s"], 0),
                     _fmt(r["steady_bus_bytes_per_sample"], 0),
                     _fmt(r["bus_ratio_vs_sync"], 4), _fmt(r["bus_vs_design"], 4),
                     _fmt(r["mean_step_s"], 1, 1e3), _fmt(r["median_step_s"], 1, 1e3)])
    return C.format_table(headers, rows)


def markdown(result: dict[str, Any]) -> str:
    """The summary tables as Markdown (for docs/benchmarks/time-to-accuracy.md)."""
    lines = []
    for key, panel in result["panels"].items():
        s = panel["summary"]
        seeds = panel["runs"][0]["contenders"]
        lines += [f"\n**{key}** ({len(panel['runs'])} seed(s); target {s['_target_acc']:.4f}, "
                  f"median over seeds)\n",
                  "| contender | reached | time to target s | x torch DDP | "
                  + ("final val loss (worst) | loss gap % "
                     if panel.get("model") == "gpt" else "final acc (worst) | gap pp ")
                  + "| samples/s | bus B/sample | x sync bus | x design | mean step ms "
                  "| median step ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name in seeds:
            r = s[name]
            lines.append(
                f"| {name} | {r['reached']}/{r['seeds']} | {_fmt(r['time_to_target_s'])} | "
                f"{_fmt(r['ttt_vs_torch_ddp'], 3)} | {_final(panel, r['final_acc_worst'])} | "
                f"{_fmt(r['final_acc_gap_pp'], 1)} | {_fmt(r['samples_per_s'], 0)} | "
                f"{_fmt(r['steady_bus_bytes_per_sample'], 0)} | "
                f"{_fmt(r['bus_ratio_vs_sync'], 4)} | {_fmt(r['bus_vs_design'], 4)} | "
                f"{_fmt(r['mean_step_s'], 1, 1e3)} | "
                f"{_fmt(r['median_step_s'], 1, 1e3)} |")
    return "\n".join(lines) + "\n"


def report(result: dict[str, Any]) -> None:
    print(f"\nshaping: {result['why']}; target: {result['target_rule']}")
    for key, panel in result["panels"].items():
        emulation = panel["runs"][0].get("emulation", "?")
        target = panel["summary"]["_target_acc"]   # None without gradient_allreduce
        print(f"\n{key} ({emulation}); target (median over seeds) "
              + ("none (no gradient_allreduce run)" if target is None else f"{target:.4f}"))
        print(table(panel))


def plot(result: dict[str, Any], path: str) -> None:
    """Accuracy (worst replica) against wall time, one panel per shape/rate/model; the
    first seed's curves, the target dashed. The GPT: its validation loss (worst replica,
    lower is better) against wall time, the y axis cut at the first evaluations' loss."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = list(result["panels"].items())
    cols = min(2, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.5 * rows), squeeze=False)
    for ax, (key, panel) in zip(axes.flat, panels):
        run = panel["runs"][0]
        sign = -1.0 if panel.get("model") == "gpt" else 1.0
        for i, (name, r) in enumerate(run["contenders"].items()):
            style = ":" if name == CONTROL else ("--" if name in PEERS else "-")
            ax.plot([p["wall_s"] for p in r["curve"][1:]],
                    [sign * p["acc_worst"] for p in r["curve"][1:]], style, marker=".",
                    markersize=3, label=name, color=plt.cm.tab20(i % 20))
        if run.get("target_acc") is not None:
            ax.axhline(sign * run["target_acc"], color="gray", linestyle="--", linewidth=0.8)
        if panel.get("model") == "gpt":
            firsts = [-r["curve"][1]["acc_worst"] for r in run["contenders"].values()
                      if len(r["curve"]) > 1]
            lows = [-r["final_acc_worst"] for r in run["contenders"].values()]
            if firsts and lows:
                ax.set_ylim(min(lows) - 0.05, max(firsts) + 0.05)
            ax.set(ylabel="validation loss, nats/byte (worst replica)")
        else:
            ax.set(ylim=(0.0, 1.0), ylabel="test accuracy (worst replica)")
        ax.set(xscale="log", xlabel="wall time, evaluation excluded (s)",
               title=f"{key}, seed {run['seed']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, loc="upper right" if sign < 0 else "lower right")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: what the issue asks of the best relaxation's time to target against torch DDP's
ISSUE_TARGET = {1000.0: 0.25, 100.0: 0.1, 10.0: 0.05}
#: not relaxations: exact synchronous training, the peers and the control
EXACT = (SYNC, "gradient_allreduce_hier", "gradient_allreduce_muon", *PEERS, CONTROL)


def headline_markdown(result: dict[str, Any]) -> str:
    """Per panel: synchronous training's final loss, the target, torch DDP's time to it
    and the best relaxation's (least median time to target among the commlib
    contenders other than exact synchronous training), against the issue's target."""
    lines = ["| panel | seeds | sync final (worst) | target | torch DDP s | best relaxation "
             "| its s | x torch DDP | issue's target | met | its final gap % |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, panel in result["panels"].items():
        s = panel["summary"]
        peer = s.get(PEER, {})
        sync = s.get(SYNC, {})
        cands = [(r["time_to_target_s"], name) for name, r in s.items()
                 if not name.startswith("_") and name not in EXACT
                 and r["time_to_target_s"] is not None]
        best = min(cands)[1] if cands else None
        b = s[best] if best else {}
        ratio = b.get("ttt_vs_torch_ddp")
        goal = ISSUE_TARGET.get(float(panel["rate_mbit"]))
        met = "-" if goal is None or ratio is None else ("yes" if ratio <= goal else "no")
        lines.append(
            f"| {key} | {len(panel['runs'])} | {_final(panel, sync.get('final_acc_worst'))} "
            f"| {_final(panel, s['_target_acc'])} | {_fmt(peer.get('time_to_target_s'))} "
            f"| {best or 'none reached'} | {_fmt(b.get('time_to_target_s'))} "
            f"| {_fmt(ratio, 3)} | {'-' if goal is None else f'<= {goal:g}'} | {met} "
            f"| {_fmt(b.get('final_acc_gap_pp'), 1)} |")
    return "\n".join(lines) + "\n"
