"""The contenders of bench_time_to_accuracy: which commlib algorithm (or peer, or control)
each name trains with, its arguments per model, and the design ratio of its wire bytes.

``CONTENDERS`` holds the arguments every model uses; ``MODEL_KWARGS[model]`` overrides
them for one model (the GPT workload's settings: see benchmarks/README.md, "GPT time to
accuracy"). ``contender(name, model)`` gives what a run uses; the worker records the
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
    "torch_ddp_gloo": (None, {}, "sgd"),
    "torch_ddp_powersgd": (None, {"rank": 4, "start_iter": "epoch"}, "sgd"),
    "control_nocomm": (None, {}, "sgd"),
}
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

#: per-model overrides of CONTENDERS' arguments (the GPT workload, README "GPT time to
#: accuracy": async_model_average averages every 4 iterations, a round overlapped with
#: the next one, instead of every 50 ms: see the README for the measured reason)
MODEL_KWARGS: dict[str, dict[str, dict[str, Any]]] = {
    "gpt": {"async_model_average": {"sync_every_steps": 4}},
}


def contender(name: str, model: str) -> tuple[str | None, dict[str, Any], str]:
    """(algorithm, arguments, optimizer kind) of contender ``name`` on ``model``."""
    algorithm, kwargs, opt_kind = CONTENDERS[name]
    over = MODEL_KWARGS.get(model, {}).get(name)
    if over is not None:   # an override replaces the arguments (not merged: the timer
        kwargs = dict(over)  # and the step interval of async_model_average exclude each other)
    return algorithm, dict(kwargs), opt_kind


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
