"""Train every built-in algorithm and save or resume it; driven by test_resume.py.

Usage (under mpiexec): python resume_program.py MODE DIR K [CONFIG ...]

* ``first``: for each config, an uninterrupted run of 2K iterations (final state to
  ``DIR/NAME.full.RANK``), and a run of K iterations that saves model, optimizer and
  algorithm state (``DIR/NAME.ckpt.RANK``) and stops;
* ``second``: a fresh wrapper loads the checkpoint, checks that the algorithm restored
  exactly what was saved, trains K more iterations and saves its final state
  (``DIR/NAME.resumed.RANK``); for the configs in :data:`NEEDS_STATE`, a second fresh
  wrapper loads model and optimizer only (a negative control, ``DIR/NAME.skipped.RANK``).

Every batch is a function of (rank, iteration), so both runs see the same data. The model
spans three buckets and the optimizer has two param groups.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import commlib  # noqa: E402
from algo_harness import (  # noqa: E402
    BUCKET_MB,
    batch_indices,
    digits,
    model,
    param_groups,
    wait_for_rounds,
)
from commlib.algorithms.qadam import QAdamOptimizer  # noqa: E402

KFAC = dict(factor_update_steps=2, inv_update_steps=3, damping=0.01, kl_clip=1e-3)

# name: (algorithm, its arguments, optimizer: "sgd" | "qadam" | ("qadam", lr))
CONFIGS = {
    "gradient_allreduce": ("gradient_allreduce", {}, "sgd"),
    "bytegrad": ("bytegrad", dict(chunk_size=256), "sgd"),
    "qadam": ("qadam", dict(warmup_steps=2, chunk_size=256), "qadam"),
    "qadam_uint8": ("qadam", dict(warmup_steps=2, compression="minmax_uint8"), "qadam"),
    "qadam_boundary": ("qadam", dict(warmup_steps="K"), "qadam"),  # saved as warm-up ends
    "qadam_no_warmup": ("qadam", dict(warmup_steps=0), ("qadam", 1.0)),
    "decentralized": ("decentralized", {}, "sgd"),
    "decentralized_shift_one": ("decentralized", dict(peer_selection_mode="shift_one",
                                                      communication_interval=3), "sgd"),
    "low_precision_decentralized": ("low_precision_decentralized", dict(chunk_size=256), "sgd"),
    "local_sgd": ("local_sgd", dict(sync_every=3), "sgd"),               # saved mid-period
    "local_sgd_due": ("local_sgd", dict(sync_every=2), "sgd"),           # average pending
    "async_model_average": ("async_model_average", dict(sync_interval_ms=1, warmup_steps=2),
                            "sgd"),
    "async_no_warmup": ("async_model_average", dict(sync_interval_ms=1), "sgd"),
    # rounds in steps, K=4: the round launched after iteration 3 in flight, due after 4
    "async_steps": ("async_model_average", dict(sync_every_steps=2, warmup_steps=1), "sgd"),
    "d_kfac": ("d_kfac", KFAC, "sgd"),
    "dp_kfac": ("dp_kfac", KFAC, "sgd"),
    "diloco": ("diloco", dict(sync_every=3), "sgd"),                     # saved mid-period
    "diloco_due": ("diloco", dict(sync_every=2, outer_nesterov=False), "sgd"),  # step pending
    # K=4: fragment 0's int4 exchange (launched at 3) in flight, its outer step pending
    "streaming_diloco": ("streaming_diloco", dict(sync_every=4, num_fragments=2,
                                                  fragment_sync_delay=1, quantize="int4",
                                                  error_feedback=True,
                                                  fragment_update_alpha=0.5), "sgd"),
    "streaming_diloco_int8": ("streaming_diloco", dict(sync_every=6, num_fragments=3,
                                                       quantize="int8"), "sgd"),
    "powersgd": ("powersgd", dict(rank=2, start_iter=2), "sgd"),         # compressing
    "powersgd_no_warm_start": ("powersgd", dict(rank=1, start_iter=2, warm_start=False),
                               "sgd"),
}
#: configs whose trajectory depends on the timing of background rounds
TIMED = {"async_model_average", "async_no_warmup"}
#: negative control: resumed without loading the algorithm state, these must differ
NEEDS_STATE = {"qadam", "qadam_no_warmup", "decentralized_shift_one",
               "low_precision_decentralized", "local_sgd_due", "d_kfac", "dp_kfac",
               "diloco", "diloco_due", "async_steps", "streaming_diloco", "streaming_diloco_int8", "powersgd",
               "powersgd_no_warm_start"}


def build(name: str, k: int):
    algorithm, kwargs, optimizer = CONFIGS[name]
    kwargs = {key: (k if value == "K" else value) for key, value in kwargs.items()}
    ddp = commlib.DistributedDataParallel(model(), algorithm=algorithm,
                                          bucket_cap_mb=BUCKET_MB, **kwargs)
    assert len(ddp._ctx.buckets) >= 3, ddp._ctx.buckets
    if optimizer == "sgd":
        opt = torch.optim.SGD(param_groups(ddp.module), lr=0.1, momentum=0.9)
    else:
        lr = optimizer[1] if isinstance(optimizer, tuple) else 0.01
        weights, biases = param_groups(ddp.module, weight_decay=0.01)
        biases["betas"] = (0.8, 0.99)
        opt = QAdamOptimizer([weights, biases], lr=lr)
    return ddp, opt


def train(ddp, opt, first: int, last: int) -> None:
    rank, n = commlib.get_rank(), commlib.get_world_size()
    x, y = digits()
    for step in range(first, last):
        idx = batch_indices(rank, n, step)
        opt.zero_grad()
        F.cross_entropy(ddp(x[idx]), y[idx]).backward()
        opt.step()


def snapshot(ddp, opt) -> dict:
    return {"model": ddp.module.state_dict(), "optimizer": opt.state_dict(),
            "algorithm": ddp.algorithm.state_dict()}


def same(a, b) -> bool:
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype \
            and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and \
            all(same(u, v) for u, v in zip(a, b))
    return a == b


def main(mode: str, directory: str, k: int, names: list[str]) -> None:
    torch.set_num_threads(1)
    commlib.init()
    rank = commlib.get_rank()
    path = lambda name, kind: os.path.join(directory, f"{name}.{kind}.{rank}")  # noqa: E731
    for name in names:
        if mode == "first":
            ddp, opt = build(name, k)
            try:
                train(ddp, opt, 0, 2 * k)
                torch.save(snapshot(ddp, opt), path(name, "full"))
            finally:
                ddp.close()
            ddp, opt = build(name, k)
            try:
                train(ddp, opt, 0, k)
                torch.save(snapshot(ddp, opt), path(name, "ckpt"))
            finally:
                ddp.close()
        else:
            saved = torch.load(path(name, "ckpt"), weights_only=False)
            ddp, opt = build(name, k)
            try:
                timed = name in TIMED
                if timed:  # no background round between loading and checking
                    ddp.algorithm.abort()
                ddp.module.load_state_dict(saved["model"])
                opt.load_state_dict(saved["optimizer"])
                ddp.algorithm.load_state_dict(saved["algorithm"])
                restored = same(ddp.algorithm.state_dict(), saved["algorithm"])
                if timed:
                    ddp.algorithm.resume()
                train(ddp, opt, k, 2 * k)
                if timed:  # background averaging runs again after the resume
                    wait_for_rounds(ddp.algorithm, 2)
                out = snapshot(ddp, opt)
                out.update(restored=restored,
                           rounds=ddp.algorithm.rounds if timed else None)
                torch.save(out, path(name, "resumed"))
            finally:
                ddp.close()
            if name in NEEDS_STATE:
                ddp, opt = build(name, k)
                try:
                    ddp.module.load_state_dict(saved["model"])
                    opt.load_state_dict(saved["optimizer"])
                    train(ddp, opt, k, 2 * k)
                    torch.save(snapshot(ddp, opt), path(name, "skipped"))
                finally:
                    ddp.close()
    print(f"rank {rank}: {mode} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:] or list(CONFIGS))
