"""The worker of bench_time_to_accuracy: one mpiexec job = one (shape, model, seed), every
contender in turn on the same data, seed and schedule (module doc of
bench_time_to_accuracy). Started by the driver as ``bench_time_to_accuracy.py --worker``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Any

from bench_time_to_accuracy_contenders import CONTROL, PEER_PSGD, PEERS, contender


def powersgd_elements(module: Any, rank: int, min_rate: float = 2.0) -> int:
    """Elements PowerSGD moves per compressed step (torch's rule: P and Q of each matrix
    worth compressing, every other tensor whole)."""
    from commlib.algorithms.powersgd import should_compress
    sent = 0
    for p in module.parameters():
        if p.dim() < 2:
            sent += p.numel()
            continue
        rows, cols = p.shape[0], p[0].numel()
        r = min(rows, cols, rank)
        sent += (rows + cols) * r if should_compress(rows, cols, r, min_rate) else p.numel()
    return sent


def message_bytes(algorithm: str, module: Any, kwargs: dict[str, Any]) -> int | None:
    """One rank's message per exchange of a gathered algorithm (sparseloco, muloco with
    int2, demo) for ``module``'s parameters, from the algorithm's own layout functions
    (per tensor: sparseloco's byte rounding per bucket is not reproduced); None for the
    others (the cost model's closed forms then)."""
    import inspect
    params = [p for p in module.parameters() if p.requires_grad]
    if algorithm == "sparseloco":
        from commlib.algorithms.sparseloco import SparseLoCo, layout
        a = {k: v.default for k, v in inspect.signature(SparseLoCo).parameters.items()}
        a.update(kwargs)
        return sum(layout([p.numel()], a["chunk_size"], a["density"], a["value_bits"]).nbytes
                   for p in params)
    if algorithm == "muloco":
        from commlib.algorithms.muloco import MuLoCo, _int2_nbytes
        a = {k: v.default for k, v in inspect.signature(MuLoCo).parameters.items()}
        a.update(kwargs)
        if a["compression"] != "int2":
            return None
        return sum(_int2_nbytes(p.numel()) for p in params)   # muloco's own int2 sizes
    if algorithm == "demo":
        from commlib.algorithms.demo import DeMo, bytes_per_step
        a = {k: v.default for k, v in inspect.signature(DeMo).parameters.items()}
        a.update(kwargs)
        return bytes_per_step([p.shape for p in params], a["chunk_size"], a["topk"],
                              params[0].element_size())
    return None


def _torch_powersgd_hook(rank: int, start_iter: int) -> tuple[Any, Any]:
    """torch's PowerSGD state and hook; the hook waits for each bucket's future (torch's
    hook issues its P and Q allreduces from gloo's callback thread, and with several
    buckets the ranks' collectives can interleave differently: gloo aborts)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                               start_powerSGD_iter=start_iter)

    def hook(state, bucket):  # no annotations: torch checks them
        future = psgd.powerSGD_hook(state, bucket)
        future.wait()
        return future

    return state, hook


def build_model(kind: str, width: int) -> Any:
    from torch import nn
    if kind == "cnn":
        from commlib.examples.train_digits import DigitsCNN
        return DigitsCNN()
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(),
                             nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    if kind == "gpt":
        import gpt
        return gpt.GPT(gpt.SIZES[GPT_SIZE[0]])
    raise ValueError(f"--models: unknown model {kind!r} (expected cnn, mlp or gpt)")


GPT_SIZE = ["small"]   # set from --gpt-size in the worker


class Data:
    """What a contender trains and is scored on: digits (accuracy) or the GPT corpus
    (validation loss, scored as its negative so that higher is better everywhere)."""

    def __init__(self, args: argparse.Namespace, n: int) -> None:
        import commlib
        self.args, self.n, self.rank = args, n, commlib.get_rank()
        self.gpt = args.model == "gpt"
        if self.gpt:
            import gpt
            GPT_SIZE[0] = args.gpt_size
            self.cfg = gpt.SIZES[args.gpt_size]
            self.corpus = gpt.corpus(args.gpt_bytes)
            self.steps_per_epoch = args.gpt_steps_per_epoch
            self.labels = None
        else:
            from commlib.examples.train_digits import load_digits_split
            train, test = load_digits_split(args.seed)
            self.x_train, self.y_train = train.tensors
            self.x_test, self.y_test = test.tensors
            self.labels = self.y_train
            self.steps_per_epoch = math.ceil(math.ceil(len(self.y_train) / n) / args.batch)

    def epoch(self, name: str, epoch: int) -> list[Any]:
        """This rank's batches of ``epoch``: (inputs, targets) pairs."""
        import torch
        if self.gpt:
            import gpt
            data = self.corpus["train"]
            if name == CONTROL:    # each rank alone on its own slice of the corpus
                per = data.numel() // self.n
                data = data[self.rank * per:(self.rank + 1) * per]
            g = torch.Generator().manual_seed(self.args.seed * 1_000_003 + epoch * 7919
                                              + self.rank)
            return [gpt.batch(data, self.args.batch, self.cfg.context, g)
                    for _ in range(self.steps_per_epoch)]
        order = _shard(name, len(self.y_train), self.y_train, self.rank, self.n,
                       self.args.seed, epoch)
        out = []
        for i in range(0, len(order), self.args.batch):
            idx = torch.tensor(order[i:i + self.args.batch])
            out.append((self.x_train[idx], self.y_train[idx]))
        return out

    def loss(self, model: Any, x: Any, y: Any) -> Any:
        import torch.nn.functional as F
        if self.gpt:
            import gpt
            return gpt.loss(model, x, y)
        return F.cross_entropy(model(x), y)

    def score(self, module: Any) -> float:
        """Accuracy on the test set, or minus the validation loss (nats per byte)."""
        import torch
        if self.gpt:
            import gpt
            return -gpt.val_loss(module, self.corpus["val"], self.cfg.context,
                                 windows=self.args.gpt_eval_windows)
        module.eval()
        with torch.no_grad():
            right = (module(self.x_test).argmax(1) == self.y_test).sum().item()
        module.train()
        return right / len(self.y_test)


def _shard(name: str, n_train: int, labels: Any, rank: int, n: int, seed: int,
           epoch: int) -> list[int]:
    """This rank's sample order for ``epoch``: the DistributedSampler of train_digits, or
    for the control a contiguous block of the label-sorted set (label skew), shuffled."""
    import torch
    from torch.utils.data import DistributedSampler
    if name != CONTROL:
        sampler = DistributedSampler(range(n_train), num_replicas=n, rank=rank, shuffle=True,
                                     seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)
    order = torch.argsort(labels, stable=True)
    per = math.ceil(n_train / n)
    block = order[rank * per:(rank + 1) * per]
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    return block[torch.randperm(len(block), generator=g)].tolist()


def _gloo(rank: int) -> Any:
    """torch.distributed over gloo at rank 0's address (commlib publishes it as
    MASTER_ADDR/MASTER_PORT; on an emulated cluster it is node 0's link address)."""
    import socket

    import numpy as np
    import torch.distributed as dist

    import commlib
    if dist.is_initialized():
        return dist
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        # published by commlib at import (rank 0's address on its node's link)
        dist.init_process_group("gloo", rank=rank, world_size=commlib.get_world_size())
        return dist
    addr = None
    info = np.zeros(5, dtype=np.int64)
    if rank == 0:
        if not addr:
            try:
                addr = socket.gethostbyname(socket.gethostname())
            except OSError:
                addr = "127.0.0.1"
        with socket.socket() as s:
            s.bind((addr, 0))
            info[4] = s.getsockname()[1]
        info[:4] = [int(p) for p in addr.split(".")]
    commlib.broadcast(info, src=0)
    host = ".".join(str(int(p)) for p in info[:4])
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{int(info[4])}",
                            rank=rank, world_size=commlib.get_world_size())
    return dist


def _make(name: str, args: argparse.Namespace, module: Any, kwargs: dict) -> tuple[Any, Any]:
    """(the model to train, the commlib wrapper or None) for contender ``name``."""
    import torch

    import commlib
    algorithm = contender(name, args.model, args.set)[0]
    if algorithm is not None:
        ddp = commlib.DistributedDataParallel(module, algorithm=algorithm, **kwargs)
        return ddp, ddp
    if name in PEERS:
        _gloo(commlib.get_rank())
        model = torch.nn.parallel.DistributedDataParallel(module)
        if name == PEER_PSGD:
            model.register_comm_hook(*_torch_powersgd_hook(kwargs["rank"],
                                                           kwargs["start_iter"]))
        return model, None
    return module, None     # the control: every rank alone


def _optimizer(opt_kind: str, args: argparse.Namespace, model: Any, data: Data) -> Any:
    import torch
    base = (args.gpt_lr if data.gpt else args.lr) / (10 if opt_kind == "qadam" else 1)
    if opt_kind == "qadam":
        from commlib.algorithms.qadam import QAdamOptimizer
        return QAdamOptimizer(model.parameters(), lr=base)
    if opt_kind == "muon":
        from commlib.algorithms.muloco import muloco_inner_optimizer
        return muloco_inner_optimizer(model, adamw_lr=base, weight_decay=0.0)
    if opt_kind == "sign":
        return torch.optim.SGD(model.parameters(), lr=base, momentum=0.0)
    if data.gpt:
        return torch.optim.AdamW(model.parameters(), lr=base, weight_decay=0.0)
    return torch.optim.SGD(model.parameters(), lr=base, momentum=0.9)


def warm_up(name: str, args: argparse.Namespace, data: Data) -> None:
    """Three untimed steps of ``name`` on a throwaway model: JIT-compiled kernels, gloo's
    connections and workspaces are made here, not inside the timed run."""
    import commlib
    algorithm, kwargs, opt_kind = contender(name, args.model, args.set)
    kwargs = {k: (2 if v == "epoch" else v) for k, v in kwargs.items()}
    model, ddp = _make(name, args, build_model(args.model, args.width), kwargs)
    opt = _optimizer(opt_kind, args, model, data)
    for group in opt.param_groups:
        group["lr"] = 0.0
    x, y = data.epoch(name, 0)[0]
    for _ in range(3):
        opt.zero_grad()
        data.loss(model, x, y).backward()
        opt.step()
    if ddp is not None:
        ddp.close()
    commlib.barrier()


def run_contender(name: str, args: argparse.Namespace, data: Data) -> dict:
    """Train ``name`` from scratch; the curve and the summary (same on every rank)."""
    import numpy as np
    import torch

    import commlib
    from commlib.base import accounting

    n = commlib.get_world_size()
    algorithm, kwargs, opt_kind = contender(name, args.model, args.set)
    steps_per_epoch = data.steps_per_epoch
    total_steps = steps_per_epoch * args.epochs
    kwargs = {k: (steps_per_epoch if v == "epoch" else v) for k, v in kwargs.items()}

    torch.manual_seed(args.seed)
    module = build_model(args.model, args.width)
    params = sum(p.numel() for p in module.parameters())
    model, ddp = _make(name, args, module, kwargs)
    opt = _optimizer(opt_kind, args, model, data)
    base_lr = opt.param_groups[0]["lr"]
    # what torch DDP hands to gloo per step: every gradient once (bus: ring allreduce);
    # with torch's PowerSGD hook, once compressing, the P, Q and uncompressed elements
    peer_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    design = None
    if name in ("powersgd", PEER_PSGD):
        design = powersgd_elements(module, kwargs["rank"]) / params
    message = message_bytes(algorithm, module, kwargs) if algorithm else None
    evaluate = lambda: data.score(module)  # noqa: E731

    # async_model_average averages on a timer in the background: stopped at every
    # evaluation (after its current round, on every rank), restarted after it
    background = algorithm == "async_model_average"
    curve: list[dict[str, Any]] = []
    wall, sent, bus, step, samples = 0.0, 0, 0, 0, 0
    durations: list[float] = []

    def checkpoint(segment: float) -> None:
        """Stop the clock: count the training bytes, add the slowest rank's training
        time since the last evaluation, score every replica, restart together."""
        nonlocal sent, bus, wall
        if background:   # no averaging round while the clock stands still
            ddp.algorithm.abort()
        if algorithm == "streaming_diloco":   # its bytes belong to training, not to the
            ddp.algorithm.wait_exchange()     # evaluation (its outer step stays due)
        counters = commlib.stats(reset=True)        # bytes of training since the last one
        sent += accounting.total(counters, "bytes")
        bus += accounting.total(counters, "bus_bytes")
        wall += float(commlib.allreduce(np.array([segment]), op="max")[0])
        accs = np.asarray(commlib.allgather(np.array([evaluate()]))).ravel()
        curve.append({"step": step, "wall_s": wall, "acc": [float(a) for a in accs],
                      "acc_worst": float(min(accs)), "acc_mean": float(np.mean(accs)),
                      "samples_rank0": None, "bytes_rank0": None, "bus_bytes_rank0": None,
                      "_samples": samples, "_bytes": sent, "_bus": bus})
        commlib.barrier()
        commlib.stats(reset=True)                   # drop the evaluation's own bytes
        if background:
            ddp.algorithm.resume()

    commlib.barrier()
    commlib.stats(reset=True)
    checkpoint(0.0)
    for epoch in range(args.epochs):
        for x, y in data.epoch(name, epoch):
            factor = 0.5 * (1 + math.cos(math.pi * step / total_steps))
            for group in opt.param_groups:
                group["lr"] = base_lr * factor
            start = time.perf_counter()
            opt.zero_grad()
            data.loss(model, x, y).backward()
            opt.step()
            seconds = time.perf_counter() - start
            durations.append(seconds)
            step += 1
            samples += len(x)
            if name in PEERS:
                moved = peer_bytes
                if name == PEER_PSGD and step > kwargs["start_iter"]:
                    moved = int(round(peer_bytes * design))
                sent += moved
                bus += 2 * (n - 1) * moved // n
            if step % args.eval_every == 0 or step == total_steps:
                checkpoint(sum(durations[-(step - curve[-1]["step"]):]))
    if ddp is not None:
        ddp.close()
    if name in PEERS:
        import torch.distributed as dist
        dist.barrier()
    times = np.array([statistics.median(durations), sum(durations) / len(durations)])
    median_s, mean_s = commlib.allreduce(times, op="max")
    # rank 0's counts on every rank (the summary is written by rank 0)
    for point in curve:
        s, b, u = commlib.broadcast(np.array([point.pop("_samples"), point.pop("_bytes"),
                                              point.pop("_bus")], dtype=np.int64), src=0)
        point.update(samples_rank0=int(s), bytes_rank0=int(b), bus_bytes_rank0=int(u))
    last = curve[-1]
    return {"algorithm": algorithm, "kwargs": kwargs, "optimizer": opt_kind,
            "params": params, "steps": step, "steps_per_epoch": steps_per_epoch,
            "wall_s": last["wall_s"], "samples_per_s": samples * n / last["wall_s"],
            "mean_step_s": float(mean_s), "median_step_s": float(median_s),
            "bytes_per_sample": last["bytes_rank0"] / last["samples_rank0"],
            "bus_bytes_per_sample": last["bus_bytes_rank0"] / last["samples_rank0"],
            "bytes_counted": name not in PEERS, "design_bus_ratio": design,
            "message_ratio": None if message is None else message / (4 * params),
            "metric": "val_loss" if data.gpt else "accuracy",
            "final_acc_worst": last["acc_worst"], "final_acc_mean": last["acc_mean"],
            "curve": curve}


def worker(args: argparse.Namespace) -> None:
    import torch

    import commlib
    commlib.init()
    torch.set_num_threads(1)
    data = Data(args, commlib.get_world_size())
    results = {}
    for name in args.algorithms.split(","):
        warm_up(name, args, data)
        results[name] = run_contender(name, args, data)
        if commlib.get_rank() == 0:
            r = results[name]
            what = "val loss worst" if data.gpt else "final acc worst"
            value = -r["final_acc_worst"] if data.gpt else r["final_acc_worst"]
            print(f"  {name:<28} {what} {value:.4f}  "
                  f"wall {r['wall_s']:.2f}s  mean step {r['mean_step_s'] * 1e3:.1f} ms",
                  flush=True)
    extra = {"corpus_digest": data.corpus["digest"], "gpt_size": args.gpt_size} \
        if data.gpt else {}
    if commlib.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump({"ranks": commlib.get_world_size(), "contenders": results, **extra}, fh)
