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
* ``sparseloco`` (H = ``sync_every``, 15), ``muloco`` (H = 30, int2) and ``demo`` (every
  step): one allgather of each rank's compressed message ``M = rho S`` per exchange
  (``log2 N`` latencies; each node link carries ``R (N-R) M``, the node ``(R-1) M``);
  ``rho`` = 1/136.5 (sparseloco: 64 of 4096 values per chunk, 12-bit index, 2-bit code,
  8 bytes of scales), 1/16 (muloco's int2), ``k (4 + w) / 4 s^2`` (demo, ASSUMING ``s x s``
  chunks of matrices; 1/85.3 with s = 64, k = 32), or a run's exact ``message_ratio``.
  Bus bytes against a synchronous allreduce: ``N rho / 2`` per exchange, so they grow with
  N (an allgather), unlike every other row. No overlap with compute.
* ``async_model_average``: the averaging runs beside training; ``0`` on the step (with
  ``sync_every_steps=k``: ``allreduce(S) / k`` of bytes, hidden behind the next step).
* torch DDP over gloo: gloo's ring, ``2 (N-1)`` latencies and ``2 (N-1)/N * S`` on the
  node link (one ring edge leaves each node).

**Compute and per-algorithm CPU.** Step time = calibrated base + communication(shape).
The base of an algorithm is its mean step time measured on the UNSHAPED cluster of the
same shape minus the formula's communication time on that cluster's measured links: it
holds forward, backward, the optimizer and the algorithm's own CPU work (bucket copies,
compression kernels) on our 2 shared cores; the compute that hides the overlapped
exchanges (streaming_diloco's, async_model_average's in steps) is the control's unshaped
mean step (no communication; else the panel's least). Validation: every shaped run (1 Gbit/s etc.)
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
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402

# the model's parts, re-exported: the formulas, the validation on the emulated runs, the
# predictions at scale and the recommendation
from cost_model_formulas import (  # noqa: E402,F401
    MODELLED,
    PEER,
    SYNC,
    WIRE,
    Cluster,
    Tier,
    bytes_ratio,
    comm_time,
)
from cost_model_report import emulated_recommendation  # noqa: E402
from cost_model_report import markdown as report_markdown  # noqa: E402
from cost_model_scale import (  # noqa: E402,F401
    GPT,
    SCALE,
    contender_args,
    plot,
    predict,
    recommend,
    steps_ratio,
)
from cost_model_validate import (  # noqa: E402,F401
    _load,
    calibrate,
    cluster_of,
    model_bytes,
    row_comm,
    validate,
    validate_bytes,
)


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
    p.add_argument("--markdown", default=None,
                   help="also write the validation, the bytes check and the recommendation "
                        "tables (emulated cluster and at scale) as Markdown")
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
    used = contender_args({k: v for k, v in shaped.items() if v["model"] == model})
    if args.workload == "gpt":   # PowerSGD's ratio of a run of another size does not apply
        sizes: dict[str, int] = {}   # the panel contender_args took each one from
        for p in shaped.values():
            if p["model"] == "gpt":
                for n, r in p["runs"][0]["contenders"].items():
                    sizes.setdefault(n, r["params"])
        for name, a in used.items():
            if sizes.get(name) != scale["model_bytes"] / 4:
                a["psgd_ratio"] = None
    rows = predict(ratios, scale, used)
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
    if args.markdown:
        emulated = emulated_recommendation(shaped, unshaped, base)
        with open(args.markdown, "w") as fh:
            fh.write(report_markdown(checks, byte_checks, emulated, best, scale))
        print(f"markdown: {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
