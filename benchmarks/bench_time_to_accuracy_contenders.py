"""The contenders of bench_time_to_accuracy: which commlib algorithm (or peer, or control)
each name trains with, its arguments per model, and the design ratio of its wire bytes.

``CONTENDERS`` holds the arguments every model uses; ``MODEL_KWARGS[model]`` overrides
them for one model (the GPT workload's settings: see docs/benchmarks/time-to-accuracy.md). ``contender(name, model)`` gives what a run uses; the worker records the
resolved arguments with every run (``kwargs``), and the scoring and the cost model read
them from there.
"""
from __future__ import annotations

from typing import Any

# name -> (commlib algorithm or None for a peer/control, algorithm kwargs, optimizer kind)
CONTENDERS: dict[str, tuple[str | None, dict[str, Any], str]] = {
    "gradient_allreduce": ("gradient_allreduce", {}, "sgd"),
    "gradient_allreduce_hier": ("gradient_allreduce", {"hierarchical": True}, "sgd"),
    "bytegrad": ("bytegrad", {}, "sgd"),
    "qadam": ("qadam", {"warmup_steps": "epoch"}, "qadam"),
    "decentralized": ("decentralized", {"peer_selection_mode": "shift_one"}, "sgd"),
    "low_precision_decentralized": ("low_precision_decentralized", {}, "sgd"),
    "local_sgd": ("local_sgd", {"sync_every": 4}, "sgd"),
    "async_model_average": ("async_model_average", {"sync_interval_ms": 50}, "sgd"),
    "diloco": ("diloco", {"sync_every": 8, "outer_lr": 0.7, "outer_momentum": 0.5}, "sgd"),
    "streaming_diloco": ("streaming_diloco", {"sync_every": 8, "num_fragments": 2,
                                              "fragment_sync_delay": 1, "quantize": "int4",
                                              "outer_lr": 0.7, "outer_momentum": 0.5}, "sgd"),
    "powersgd": ("powersgd", {"rank": 4, "start_iter": "epoch"}, "sgd"),
    # issue 32's frontier, at DiLoCo's interval (defaults of their papers otherwise; the
    # GPT's tuning below): chunked top-k 2-bit pseudo-gradients with error feedback;
    # MuLoCo's 2-bit statistical quantizer with Muon inside; DeMo's top-k DCT momentum
    # with the sign update (plain SGD at the model's learning rate); the GPT's tuned
    # settings are in MODEL_KWARGS (tuning table: results/tta_gpt_2x1_tuning.json)
    "sparseloco": ("sparseloco", {"sync_every": 8}, "sgd"),
    "muloco": ("muloco", {"sync_every": 8}, "muon"),
    "demo": ("demo", {"chunk_size": 64, "topk": 32}, "sign"),
    # synchronous training with MuLoCo's inner optimizer (Muon for matrices, AdamW for
    # the rest): what muloco's loss owes to Muon rather than to its outer loop
    "gradient_allreduce_muon": ("gradient_allreduce", {}, "muon"),
    "torch_ddp_gloo": (None, {}, "sgd"),
    "torch_ddp_powersgd": (None, {"rank": 4, "start_iter": "epoch"}, "sgd"),
    "control_nocomm": (None, {}, "sgd"),
    # async_model_average on its 50 ms timer whatever the model (the GPT's own is in
    # steps): named explicitly only, to show what the timer does on a workload
    "async_model_average_ms": ("async_model_average", {"sync_interval_ms": 50}, "sgd"),
}
#: what runs without --algorithms
DEFAULT_ALGORITHMS = tuple(n for n in CONTENDERS if n != "async_model_average_ms")
#: optimizer kinds: "sgd" (SGD with momentum; AdamW on the GPT), "qadam" (QAdamOptimizer),
#: "muon" (muloco_inner_optimizer: Muon for matrices, AdamW for the rest), "sign" (plain
#: SGD without momentum, for DeMo's sign update)
OPTIMIZER_KINDS = ("sgd", "qadam", "muon", "sign")
SYNC = "gradient_allreduce"
PEER = "torch_ddp_gloo"
PEER_PSGD = "torch_ddp_powersgd"   # torch DDP + torch's powerSGD_hook over gloo
PEERS = (PEER, PEER_PSGD)
CONTROL = "control_nocomm"
# design ratio of wire bytes per sample against gradient_allreduce (after warm-ups) with
# the default arguments; powersgd's follows from the model's shapes (each run's
# "design_bus_ratio"); design() gives it for a run's own arguments
DESIGN = {"bytegrad": 0.25, "qadam": 1 / 32, "local_sgd": 1 / 4, "diloco": 1 / 8,
          "streaming_diloco": 1 / 64}
#: bytes on the wire per fp32 element of the min-max codecs (headers: see cost_model)
_CODES = {"int4": 1 / 8, "int8": 1 / 4, None: 1.0}

#: per-model overrides of CONTENDERS' arguments (the GPT workload; the measurements
#: behind them: docs/benchmarks/time-to-accuracy.md): async_model_average averages every 4
#: iterations (a round overlapped with the next one) after one epoch of synchronous ones
#: (12 of the grid's 60 steps), instead of every 50 ms from the start; local SGD every 2
#: iterations (every 4 ended 1.3 % above synchronous training on the `small` GPT);
#: PowerSGD (ours and torch's hook) at rank 8, not 4
MODEL_KWARGS: dict[str, dict[str, dict[str, Any]]] = {
    "gpt": {"async_model_average": {"sync_every_steps": 4, "warmup_steps": "epoch"},
            "local_sgd": {"sync_every": 2},
            # the 2x1 tuning table (results/tta_gpt_2x1_tuning.json): at 60 steps the
            # paper's long intervals leave too few outer steps for the error feedback
            # (H = 8: +6.5 %, worse than never communicating); H = 2 at 1/32: +0.99 %
            "sparseloco": {"sync_every": 2, "density": 1 / 32},
            "powersgd": {"rank": 8, "start_iter": "epoch"},
            "torch_ddp_powersgd": {"rank": 8, "start_iter": "epoch"}},
}


def contender(name: str, model: str, sets: list[str] | None = None
              ) -> tuple[str | None, dict[str, Any], str]:
    """(algorithm, arguments, optimizer kind) of contender ``name`` on ``model``; ``sets``
    (``--set NAME.KEY=JSON``, e.g. ``diloco.sync_every=4``) override single arguments."""
    algorithm, kwargs, opt_kind = CONTENDERS[name]
    over = MODEL_KWARGS.get(model, {}).get(name)
    kwargs = dict(kwargs if over is None else over)   # an override replaces the arguments
    # (not merged: the timer and the step interval of async_model_average exclude each other)
    for item in sets or []:
        who, key, value = parse_set(item)
        if who == name:
            kwargs[key] = value
    return algorithm, kwargs, opt_kind


def parse_set(item: str) -> tuple[str, str, Any]:
    """``NAME.KEY=JSON`` as (name, key, value); ValueError naming ``--set`` otherwise."""
    import json
    try:
        target, text = item.split("=", 1)
        name, key = target.split(".", 1)
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"--set: {item!r} is not NAME.KEY=JSON (e.g. diloco.sync_every=4)"
                         ) from None
    if name not in CONTENDERS:
        raise ValueError(f"--set: unknown contender {name!r} in {item!r}")
    return name, key, value


def design(name: str, kwargs: dict[str, Any] | None) -> float | None:
    """Design ratio of ``name``'s wire bytes per sample against gradient_allreduce's
    with a run's resolved arguments; None where it has none (or follows the shapes)."""
    kw = kwargs or {}
    if name in ("local_sgd", "diloco") and "sync_every" in kw:
        return 1 / kw["sync_every"]
    if name == "streaming_diloco" and "sync_every" in kw:
        return _CODES[kw.get("quantize")] / kw["sync_every"]
    if name == "async_model_average" and kw.get("sync_every_steps"):
        return 1 / kw["sync_every_steps"]
    return DESIGN.get(name)
