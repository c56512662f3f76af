"""An alpha-beta cost model of every algorithm's step time and time to accuracy, calibrated
on the emulated two-tier cluster and extrapolated to 8-1024 ranks.

    python benchmarks/cost_model.py --calibrate benchmarks/results/time_to_accuracy_unshaped.json \\
        --validate benchmarks/results/time_to_accuracy.json \\
        --json benchmarks/results/cost_model.json --plot benchmarks/results/cost_model.png

**Tiers.** A message of ``m`` bytes costs ``alpha + m * beta`` on a tier. Each emulated run
of ``bench_time_to_accuracy`` measured its links before training (``netsim``'s probe: a
1-byte ping-pong and the best of three 4 MiB one-way transfers, MPI point to point):
``alpha = rtt / 2``, ``beta = 1 / bandwidth``, inter-node between two nodes' ranks and
intra-node between two ranks of one node (shared memory).

**Communication per step** (``S`` the fp32 bytes of the model, ``N`` ranks, ``R`` per node,
``P = N / R`` nodes, ranks placed node by node; a node link is full duplex, so the time of
a phase is the bytes its busiest node link carries in one direction):

* ``allreduce`` (flat; MPICH's recursive halving / doubling for large messages): step ``k``
  pairs ranks ``2^k`` apart and moves ``S / 2^(k+1)`` each way, twice (reduce-scatter and
  allgather); a step within a node costs the intra tier, a step across nodes carries
  ``R`` ranks' messages on each node link. On the node link that is ``2 (P-1)/P * S``
  in all, what a ring would carry too.
* ``hierarchical``: a reduce inside the node, the flat formula among the ``P`` leaders
  (``R = 1``), a broadcast inside the node.
* compressed (``bytegrad``: ``S/4``; ``qadam``: ``S/32`` after its warm-up, a full
  allreduce during it): alltoall then allgather of the compressed size ``C``; each node
  link carries ``R (N-R)/N * C`` per phase; ``N - 1 + log2 N`` message latencies.
* ``decentralized`` (shift_one): each rank sends ``S`` to one peer, off-node for a
  fraction ``(N-R)/(N-1)`` of the rounds: ``R (N-R)/(N-1) * S`` per node link.
* ``low_precision_decentralized``: ``S/4`` to each of two ring neighbours; per node link
  two messages of ``S/4`` (the node's boundary ranks).
* ``local_sgd`` (k = its ``sync_every``, 4 by default): ``allreduce(S) / k`` per step.
* ``diloco`` (H = ``sync_every``): a weight (pseudo-gradient) allreduce every H steps:
  ``allreduce(S) / H`` per step on average, a whole ``allreduce(S)`` at the peak step; it
  blocks the step (no overlap).
* ``streaming_diloco`` (H, F = ``num_fragments``, ``fragment_sync_delay`` d, ``quantize``):
  F exchanges of a fragment of ``S / F`` per H steps, each the compressed alltoall +
  allgather of ``S / F * w`` (``w`` = 0.126 for int4, 0.252 for int8: codes plus the
  8-byte header of each 2048-element chunk; a flat allreduce without quantization): in
  total ``w / H`` of synchronous bytes per step, at the peak step one fragment's,
  ``w / F`` of DiLoCo's peak. Its exchange overlaps the d following inner steps: only
  ``max(0, exchange - d * compute)`` shows on the step.
* ``powersgd`` (rank r): ``rho S`` bytes per compressed step, ``rho`` implied by the rank
  and the layer shapes (P and Q of each matrix, vectors uncompressed; each run's
  ``design_bus_ratio``); three allreduces in sequence (vectors, P, Q: the two extra ones
  add their latencies, ``2 log2(N)`` alphas each), P and Q carrying half each; a full
  allreduce during its ``start_iter`` warm-up.
* ``async_model_average``: the averaging runs beside training; ``0`` on the step (with
  ``sync_every_steps=k``: ``allreduce(S) / k`` of bytes, hidden behind the next step).
* torch DDP over gloo: gloo's ring, ``2 (N-1)`` latencies and ``2 (N-1)/N * S`` on the
  node link (one ring edge leaves each node).

**Compute and per-algorithm CPU.** Step time = calibrated base + communication(shape).
The base of an algorithm is its mean step time measured on the UNSHAPED cluster of the
same shape minus the formula's communication time on that cluster's measured links: it
holds forward, backward, the optimizer and the algorithm's own CPU work (bucket copies,
compression kernels) on our 2 shared cores. Validation: every shaped run (1 Gbit/s etc.)
predicted from the unshaped one, error per algorithm and shape.

**Past one machine.** Predictions at 8-1024 ranks, 8 ranks per node, 10 / 25 / 100 / 400 Gbit/s
between nodes, NVLink-class inside a node (alpha 3 us, 1200 Gbit/s), inter-node alpha
10 us; a ResNet-50-like model on a GPU: ``S`` = 25.6 M fp32 parameters (102 MB), 0.20 s
of forward + backward + optimizer per step (per-GPU batch 64 on a V100-class GPU: an
ASSUMPTION, not measured here), compression on the GPU at 200 GB/s (0.5 ms per 100 MB).
Gradient exchanges (and decentralized's, which runs beside forward and backward) overlap
with the backward pass: at scale up to half the compute hides communication
(``step = compute + max(0, comm - compute / 2)``); local_sgd's and
low_precision_decentralized's exchanges do not overlap. On the emulated CPU cluster the
overlap is already inside the calibrated base. Time to accuracy = steps to target x step
time, with each algorithm's steps to target
relative to synchronous training taken from the emulated runs (the wide MLP, median over
seeds; ``--workload gpt``: the GPT runs) and ASSUMED to hold at scale; an algorithm that
missed the target there has none.

**Bytes check** (needs no calibration): every shaped run's steady bus bytes per sample of
each contender against gradient_allreduce's, measured vs the model's ratio (the same
formulas' byte terms), so the byte side of every formula is validated on each run.
``--workload gpt`` predicts for the GPT workload's parameter count instead (``S`` = 4 x the
runs' parameters, PowerSGD's ``rho`` from the runs, ``--compute-s`` per step ASSUMED).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402

SYNC, PEER, CONTROL = "gradient_allreduce", "torch_ddp_gloo", "control_nocomm"
MODELLED = ("gradient_allreduce", "gradient_allreduce_hier", "bytegrad", "qadam",
            "decentralized", "low_precision_decentralized", "local_sgd",
            "async_model_average", "torch_ddp_gloo", "diloco", "streaming_diloco", "powersgd")

#: bytes on the wire per element of the min-max codecs, chunk headers included (2048)
WIRE = {"int4": (0.5 + 8 / 2048) / 4, "int8": (1 + 8 / 2048) / 4, None: 1.0}
#: defaults of the algorithms' arguments the model reads
DEFAULTS = {"local_sgd": {"sync_every": 4}, "diloco": {"sync_every": 8},
            "streaming_diloco": {"sync_every": 8, "num_fragments": 2,
                                 "fragment_sync_delay": 1, "quantize": "int4"},
            "powersgd": {"rank": 4}}


def args_of(name: str, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    return {**DEFAULTS.get(name, {}), **(kwargs or {})}


def bytes_ratio(name: str, kwargs: dict[str, Any] | None = None,
                psgd_ratio: float | None = None) -> tuple[float, float] | None:
    """(mean bytes per step, bytes at the peak step), relative to one synchronous
    gradient allreduce, after warm-ups; None where the model has no byte term."""
    a = args_of(name, kwargs)
    if name in (SYNC, PEER):   # (hierarchical: counted per tier, not modelled in bytes)
        return 1.0, 1.0
    if name == "bytegrad":
        return 0.25, 0.25
    if name == "qadam":
        return 1 / 32, 1 / 32
    if name == "local_sgd":
        return 1 / a["sync_every"], 1.0
    if name == "diloco":
        return 1 / a["sync_every"], 1.0
    if name == "streaming_diloco":
        w = WIRE[a["quantize"]]
        return w / a["sync_every"], w / a["num_fragments"]
    if name == "powersgd" and psgd_ratio is not None:
        return psgd_ratio, psgd_ratio
    return None


@dataclass
class Tier:
    alpha: float   # seconds per message
    beta: float    # seconds per byte

    def cost(self, nbytes: float, messages: float = 1.0) -> float:
        return messages * self.alpha + nbytes * self.beta


@dataclass
class Cluster:
    nodes: int
    per_node: int
    intra: Tier
    inter: Tier

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node


def tier_of(probe: Any, fallback: Tier) -> Tier:
    """A tier from netsim's probe ({"mbit", "rtt_ms"}); ``fallback`` when absent."""
    if not isinstance(probe, dict):
        return fallback
    return Tier(alpha=probe["rtt_ms"] / 2e3, beta=8 / (probe["mbit"] * 1e6))


# -- communication formulas ---------------------------------------------------------------

def allreduce_rhd(c: Cluster, nbytes: float) -> float:
    """Recursive halving / doubling allreduce of ``nbytes`` (see the module doc)."""
    n, r = c.ranks, c.per_node
    if n < 2:
        return 0.0
    steps = math.ceil(math.log2(n))
    total = 0.0
    for k in range(steps):
        chunk = nbytes / 2 ** (k + 1)
        if 2 ** k < r:
            total += 2 * c.intra.cost(chunk)
        else:
            total += 2 * c.inter.cost(min(r, n) * chunk)
    return total


def allreduce_hier(c: Cluster, nbytes: float) -> float:
    r = c.per_node
    local = 0.0
    if r > 1:
        local = 2 * c.intra.cost(2 * (r - 1) / r * nbytes, math.ceil(math.log2(r)))
    leaders = Cluster(c.nodes, 1, c.intra, c.inter)
    return local + allreduce_rhd(leaders, nbytes)


def ring(c: Cluster, nbytes: float) -> float:
    n = c.ranks
    if n < 2:
        return 0.0
    tier = c.inter if c.nodes > 1 else c.intra
    return tier.cost(2 * (n - 1) / n * nbytes, 2 * (n - 1))


def compressed(c: Cluster, nbytes: float) -> float:
    """alltoall + allgather of ``nbytes`` (already compressed)."""
    n, r = c.ranks, c.per_node
    if n < 2:
        return 0.0
    messages = n - 1 + math.ceil(math.log2(n))
    if c.nodes == 1:
        return c.intra.cost(2 * (n - 1) / n * nbytes, messages)
    return (c.inter.cost(2 * r * (n - r) / n * nbytes, messages)
            + c.intra.cost(2 * (r - 1) / n * nbytes))


def peer_exchange(c: Cluster, nbytes: float) -> float:
    n, r = c.ranks, c.per_node
    if n < 2:
        return 0.0
    off = (n - r) / (n - 1)
    return c.inter.cost(r * off * nbytes) + c.intra.cost((1 - off) * nbytes) \
        if c.nodes > 1 else c.intra.cost(nbytes)


def neighbours(c: Cluster, nbytes: float) -> float:
    if c.ranks < 2:
        return 0.0
    tier = c.inter if c.nodes > 1 else c.intra
    return tier.cost(2 * nbytes, 2)


def streaming_exchange(c: Cluster, nbytes: float, a: dict[str, Any],
                       compress_s_per_byte: float = 0.0) -> float:
    """Seconds of one fragment exchange of streaming_diloco."""
    frag = nbytes / a["num_fragments"]
    if a["quantize"] is None:
        return allreduce_rhd(c, frag)
    return compressed(c, frag * WIRE[a["quantize"]]) + 2 * compress_s_per_byte * frag


def powersgd_steady(c: Cluster, nbytes: float, rho: float,
                    compress_s_per_byte: float = 0.0) -> float:
    return (allreduce_rhd(c, 0.0) + 2 * allreduce_rhd(c, rho * nbytes / 2)
            + compress_s_per_byte * nbytes)


def comm_time(name: str, c: Cluster, nbytes: float, warm_fraction: float = 0.0,
              compress_s_per_byte: float = 0.0, kwargs: dict[str, Any] | None = None,
              psgd_ratio: float | None = None, compute_s: float = 0.0) -> float:
    """Communication seconds per step (mean over steps) of algorithm ``name`` that show
    on the step (streaming_diloco's overlap with ``compute_s`` per step subtracted)."""
    a = args_of(name, kwargs)
    if name == "diloco":
        return allreduce_rhd(c, nbytes) / a["sync_every"]
    if name == "streaming_diloco":
        e = streaming_exchange(c, nbytes, a, compress_s_per_byte)
        hidden = a["fragment_sync_delay"] * compute_s
        return a["num_fragments"] * max(0.0, e - hidden) / a["sync_every"]
    if name == "powersgd":
        rho = 1.0 if psgd_ratio is None else psgd_ratio
        return (warm_fraction * allreduce_rhd(c, nbytes)
                + (1 - warm_fraction) * powersgd_steady(c, nbytes, rho, compress_s_per_byte))
    if name == SYNC:
        return allreduce_rhd(c, nbytes)
    if name == "gradient_allreduce_hier":
        return allreduce_hier(c, nbytes)
    if name == "bytegrad":
        return compressed(c, nbytes / 4) + compress_s_per_byte * nbytes
    if name == "qadam":
        steady = compressed(c, nbytes / 32) + compress_s_per_byte * nbytes
        return warm_fraction * allreduce_rhd(c, nbytes) + (1 - warm_fraction) * steady
    if name in ("bytegrad_hier", "qadam_hier"):   # compress only between node leaders
        leaders = Cluster(c.nodes, 1, c.intra, c.inter)
        local = allreduce_hier(c, nbytes) - allreduce_rhd(leaders, nbytes)
        ratio = 4 if name == "bytegrad_hier" else 32
        steady = local + compressed(leaders, nbytes / ratio) + compress_s_per_byte * nbytes
        if name == "bytegrad_hier":
            return steady
        return warm_fraction * allreduce_hier(c, nbytes) + (1 - warm_fraction) * steady
    if name == "decentralized":
        return peer_exchange(c, nbytes)
    if name == "low_precision_decentralized":
        return neighbours(c, nbytes / 4) + compress_s_per_byte * nbytes
    if name == "local_sgd":
        return allreduce_rhd(c, nbytes) / a["sync_every"]
    if name == "async_model_average":
        return 0.0
    if name == PEER:
        return ring(c, nbytes)
    if name == CONTROL:
        return 0.0
    raise KeyError(name)


# -- calibration and validation -----------------------------------------------------------

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
    if row.get("algorithm") == "qadam":
        return min(1.0, kw.get("warmup_steps", 0) / row["steps"])
    if row.get("algorithm") == "powersgd":
        start = kw.get("start_iter", 0)
        start = row.get("steps_per_epoch", 0) if start == "epoch" else start
        return min(1.0, start / row["steps"])
    return 0.0


def row_comm(name: str, c: Cluster, s: float, row: dict[str, Any]) -> float:
    """``comm_time`` with a run's contender row: its arguments, warm-up, PowerSGD ratio."""
    return comm_time(name, c, s, warm_fraction(row), kwargs=row.get("kwargs"),
                     psgd_ratio=row.get("design_bus_ratio"))


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
            model = bytes_ratio(name, row.get("kwargs"), row.get("design_bus_ratio"))
            if model is None or name == SYNC or not row.get("bytes_counted", True):
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
    communication on the unshaped links)."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for key, panel in panels.items():
        run = panel["runs"][0]
        c, s = cluster_of(panel, run), model_bytes(run)
        means = panel_means(panel)
        shape = f"{panel['nodes']}x{panel['ranks_per_node']}"
        out[(shape, panel["model"])] = {
            n: means[n] - row_comm(n, c, s, run["contenders"][n])
            for n in means if n in MODELLED or n == CONTROL}
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
            comm = row_comm(name, c, s, run["contenders"][name])
            predicted = b[name] + comm
            rows.append({"panel": key, "contender": name, "measured_s": means[name],
                         "predicted_s": predicted,
                         "error": predicted / means[name] - 1,
                         "compute_only_s": b.get(CONTROL),
                         "comm_s": comm})
    return rows


# -- predictions at scale -------------------------------------------------------------------

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
                                  "psgd_ratio": row.get("design_bus_ratio")})
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
                                 kwargs=a.get("kwargs"), psgd_ratio=psgd, compute_s=compute)
                step = compute + comm
                if name in OVERLAPPED:   # exchanged while backward runs: half hides
                    step = compute + max(0.0, comm - 0.5 * compute)
                ratio = ratios.get(name.replace("_hier", "") if name in SCALE_ONLY else name)
                b = bytes_ratio(name.replace("_hier", ""), a.get("kwargs"), psgd)
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


# -- output --------------------------------------------------------------------------------

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibrate", default="",
                   help="bench_time_to_accuracy JSON file(s), comma-separated: their "
                        "unshaped panels (--rates 0) calibrate the model; without them "
                        "the step-time validation is skipped (the bytes check still runs)")
    p.add_argument("--validate", required=True,
                   help="bench_time_to_accuracy JSON file(s), comma-separated: their "
                        "shaped panels are predicted and compared")
    p.add_argument("--workload", choices=("resnet50", "gpt"), default="resnet50",
                   help="what the predictions at scale are for (module doc)")
    p.add_argument("--compute-s", type=float, default=None,
                   help="compute seconds per step at scale (ASSUMED; default 0.2 for "
                        "resnet50, 0.01 for gpt)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    unshaped = _load(args.calibrate.split(","), shaped=False) if args.calibrate else {}
    shaped = _load(args.validate.split(","), shaped=True)
    base = calibrate(unshaped)
    checks = validate(shaped, base)
    if not unshaped:
        print("no unshaped (--rates 0) panels given: the step-time validation is skipped")
    elif not checks:
        print("no shaped panel has an unshaped one of the same shape and model: the "
              "step-time validation is skipped")
    else:
        print(C.format_table(
            ["panel", "contender", "measured ms", "predicted ms", "error %", "comm ms"],
            [[r["panel"], r["contender"], C.fmt(r["measured_s"] * 1e3, 1),
              C.fmt(r["predicted_s"] * 1e3, 1), C.fmt(100 * r["error"], 1),
              C.fmt(r["comm_s"] * 1e3, 1)] for r in checks],
            title="validation: mean step time, measured vs predicted from the unshaped run"))
        within = [abs(r["error"]) <= 0.2 for r in checks]
        print(f"within 20%: {sum(within)}/{len(within)}; median |error| "
              f"{100 * statistics.median(abs(r['error']) for r in checks):.1f}%")
    byte_checks = validate_bytes(shaped)
    print(C.format_table(
        ["panel", "contender", "params", "measured", "model", "error %", "peak/sync"],
        [[r["panel"], r["contender"], r["params"], C.fmt(r["measured_ratio"], 4),
          C.fmt(r["model_ratio"], 4),
          "-" if r["error"] is None else C.fmt(100 * r["error"], 1),
          C.fmt(r["peak_ratio"], 4)] for r in byte_checks],
        title="bytes check: steady bus bytes per sample / gradient_allreduce's"))
    model = "gpt" if args.workload == "gpt" else "mlp"
    scale = dict(SCALE)
    if args.workload == "gpt":
        params = next((p["runs"][0]["contenders"][SYNC]["params"] for p in shaped.values()
                       if p["model"] == "gpt" and SYNC in p["runs"][0]["contenders"]
                       and p["runs"][0].get("gpt_size", "small") == "small"), GPT["params"])
        scale.update(model_bytes=4.0 * params, compute_s=GPT["compute_s"],
                     powersgd_ratio=GPT["powersgd_ratio"])
    if args.compute_s is not None:
        scale["compute_s"] = args.compute_s
    ratios = steps_ratio(shaped, model)
    rows = predict(ratios, scale, contender_args(
        {k: v for k, v in shaped.items() if v["model"] == model}))
    best = recommend(rows)
    print(f"predictions for {args.workload}: S = {scale['model_bytes'] / 1e6:.2f} MB fp32, "
          f"{scale['compute_s'] * 1e3:.0f} ms compute per step (ASSUMED); steps to target "
          f"from the {model} runs: " + ", ".join(
              f"{k} {C.fmt(v, 3)}" for k, v in sorted(ratios.items()) if v is not None))
    shown = (SYNC, "local_sgd", "diloco", "streaming_diloco", "powersgd")
    pick = {(r["inter_gbit"], r["ranks"], r["contender"]): r for r in rows}
    print(C.format_table(
        ["Gbit/s", "ranks", *shown],
        [[g, n, *(C.fmt(pick[(g, n, name)]["step_s"] * 1e3, 2) for name in shown)]
         for g in scale["inter_gbit"] for n in (8, 64, 1024)],
        title="predicted step time (ms), new algorithms beside synchronous"))
    print(C.format_table(["Gbit/s", "ranks", "best", "tta / sync"],
                         [[b["inter_gbit"], b["ranks"], b["best"], C.fmt(b["tta_vs_sync"], 3)]
                          for b in best], title="least predicted time to accuracy"))
    if args.json:
        C.write_json(args.json, {"workload": args.workload,
                                 "scale": {k: (v.__dict__ if isinstance(v, Tier) else v)
                                           for k, v in scale.items()},
                                 "base_s": {f"{k[0]} {k[1]}": v for k, v in base.items()},
                                 "validation": checks, "bytes_check": byte_checks,
                                 "steps_ratio": ratios,
                                 "predictions": rows, "recommendation": best})
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
