"""Time to accuracy of every algorithm and torch DDP on an emulated cluster.

    python benchmarks/bench_time_to_accuracy.py --shapes 2x2,4x1 --rates 1000 --seeds 0,1,2 \\
        --models cnn,mlp --json benchmarks/results/time_to_accuracy.json \\
        --plot benchmarks/results/time_to_accuracy.png
    python benchmarks/bench_time_to_accuracy.py --quick      # smoke test, < 3 min

Every contender (commlib's algorithms and torch DDP over gloo) trains the same model on
the same data with the same seed, per-rank batch and learning-rate schedule: scikit-learn's
digits with ``train_digits``' 80/20 split (``load_digits_split(seed)``), a distributed
sampler, and either the digits CNN or a communication-heavy wide MLP (64 -> W -> W -> 10).
Schedule: SGD (momentum 0.9) at ``--lr``, Adam-family (qadam) at ``--lr / 10``, both times
a cosine factor that falls from 1 to 0 over the run.

Every ``--eval-every`` steps the clock stops, EACH rank scores the replica it holds on the
whole test set (never an averaged model), and the clock restarts after a barrier. The
wall time of a segment is its slowest rank's; the curve is (wall time, steps, accuracy of
every replica, bytes). Target accuracy per (shape, model, seed): the final accuracy of
synchronous training (``gradient_allreduce``, flat) minus ``--tolerance`` (0.5 pp). A
contender reaches it at the first evaluation where its WORST replica is at or above it
(``None`` if never). Bytes: what rank 0 handed to MPI (``commlib.stats()``), per sample of
rank 0; torch DDP over gloo is not seen by commlib, so its bytes are computed from the
parameter sizes (one allreduce of every gradient per step). Step times: each rank's mean
(total / steps) and median, slowest rank.

``control_nocomm`` is a negative control: each rank trains alone (no communication) on a
label-skewed shard (sorted by label), so no replica can reach the target; the report must
say so. Cluster shapes (``NxR``: N nodes, R ranks each) run on ``netsim.two_tier``: each
node a network namespace (shared memory inside), nodes joined by links of ``--rates``
Mbit/s each way; without root it runs unshaped and ``JSON[...]["emulation"]`` says so.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402

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
# design ratio of wire bytes per sample against gradient_allreduce (after warm-ups);
# powersgd's follows from the model's shapes (each run's "design_bus_ratio")
DESIGN = {"bytegrad": 0.25, "qadam": 1 / 32, "local_sgd": 1 / 4, "diloco": 1 / 8,
          "streaming_diloco": 1 / 64}


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


# -- worker: one mpiexec job = one (shape, model, seed), every contender in turn ----------

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
    algorithm = CONTENDERS[name][0]
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


def _optimizer(opt_kind: str, args: argparse.Namespace, model: Any, data: "Data") -> Any:
    import torch
    base = (args.gpt_lr if data.gpt else args.lr) / (10 if opt_kind == "qadam" else 1)
    if opt_kind == "qadam":
        from commlib.algorithms.qadam import QAdamOptimizer
        return QAdamOptimizer(model.parameters(), lr=base)
    if data.gpt:
        return torch.optim.AdamW(model.parameters(), lr=base, weight_decay=0.0)
    return torch.optim.SGD(model.parameters(), lr=base, momentum=0.9)


def warm_up(name: str, args: argparse.Namespace, data: "Data") -> None:
    """Three untimed steps of ``name`` on a throwaway model: JIT-compiled kernels, gloo's
    connections and workspaces are made here, not inside the timed run."""
    import commlib
    algorithm, kwargs, opt_kind = CONTENDERS[name]
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


def run_contender(name: str, args: argparse.Namespace, data: "Data") -> dict:
    """Train ``name`` from scratch; the curve and the summary (same on every rank)."""
    import numpy as np
    import torch
    import commlib
    from commlib import accounting

    n = commlib.get_world_size()
    algorithm, kwargs, opt_kind = CONTENDERS[name]
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


# -- driver --------------------------------------------------------------------------------

def parse_shape(text: str) -> tuple[int, int]:
    try:
        nodes, per = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not NODESxRANKS (e.g. 2x2)") from None
    if nodes < 1 or per < 1 or nodes * per < 2:
        raise SystemExit(f"--shapes: {text!r} needs at least 2 ranks")
    return nodes, per


def launch(nodes: int, per: int, rate: float, delay_ms: float, argv: list[str],
           timeout: float) -> tuple[int, dict[str, Any]]:
    """Run ``argv`` (a python command line, without mpiexec) on the emulated two-tier
    cluster (``netsim.two_tier``), after measuring its links."""
    from netsim import two_tier
    with two_tier(nodes=nodes, ranks_per_node=per, rate_mbit=rate or None,
                  delay_ms=delay_ms) as cluster:
        info: dict[str, Any] = {"emulation": cluster.why, "shaped": cluster.shaped,
                                "delay_applied": cluster.delay_applied}
        if cluster.shaped:
            for label, (a, b) in (("inter_node", (0, 1)), ("intra_node", (0, 0))):
                if (label == "inter_node" and nodes < 2) or (label == "intra_node" and per < 2):
                    continue
                try:
                    info[f"measured_{label}"] = cluster.measure_bandwidth(a, b, nbytes=4 << 20)
                except Exception as exc:  # informative, not required
                    info[f"measured_{label}"] = f"failed: {exc}"
        return cluster.mpiexec(argv, timeout=timeout), info


def run_job(args: argparse.Namespace, nodes: int, per: int, rate: float, model: str,
            seed: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        path = fh.name
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--out", path,
            "--model", model, "--seed", str(seed), "--epochs", str(args.epochs),
            "--batch", str(args.batch), "--lr", str(args.lr), "--width", str(args.width),
            "--eval-every", str(args.eval_every), "--algorithms", args.algorithms,
            "--gpt-size", args.gpt_size, "--gpt-steps-per-epoch", str(args.gpt_steps_per_epoch),
            "--gpt-lr", str(args.gpt_lr), "--gpt-eval-windows", str(args.gpt_eval_windows)]
    if args.gpt_bytes:
        argv += ["--gpt-bytes", str(args.gpt_bytes)]
    started = time.perf_counter()
    code, info = launch(nodes, per, rate, args.delay_ms, argv, args.timeout)
    if code != 0:
        raise SystemExit(f"worker {nodes}x{per} {rate:g} Mbit/s {model} seed {seed} "
                         f"exited {code}")
    with open(path) as fh:
        out = json.load(fh)
    os.unlink(path)
    out.update(info, job_s=time.perf_counter() - started)
    return out


def time_to(curve: list[dict[str, Any]], target: float) -> float | None:
    """Wall time of the first evaluation whose worst replica is at or above ``target``."""
    for point in curve:
        if point["acc_worst"] >= target - 1e-12:
            return point["wall_s"]
    return None


def steady_bus_per_sample(r: dict[str, Any]) -> float:
    """Wire bytes per sample after the first epoch (qadam's warm-up is one epoch)."""
    curve = r["curve"]
    start = next((p for p in curve if p["step"] >= r["steps_per_epoch"]), curve[0])
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
        design = DESIGN.get(name, r.get("design_bus_ratio"))
        r["bus_vs_design"] = (r["bus_ratio_vs_sync"] / design
                              if design and r["bus_ratio_vs_sync"] is not None else None)
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


def drive(args: argparse.Namespace) -> dict[str, Any]:
    from netsim import can_shape
    shaped, why = can_shape()
    result: dict[str, Any] = {
        "shaped": shaped, "why": why, "tolerance": args.tolerance,
        "config": {k: getattr(args, k) for k in ("epochs", "batch", "lr", "width",
                                                  "eval_every", "delay_ms", "algorithms",
                                                  "gpt_size", "gpt_steps_per_epoch",
                                                  "gpt_lr", "gpt_bytes", "loss_tolerance")},
        "target_rule": f"final worst-replica accuracy of {SYNC} (flat) at the same shape, "
                       f"model and seed, minus {args.tolerance * 100:g} pp (gpt: its final "
                       f"worst-replica validation loss plus {args.loss_tolerance * 100:g} %)",
        "design_bus_ratio": DESIGN, "panels": {}}
    for shape in args.shapes.split(","):
        nodes, per = parse_shape(shape)
        for rate in [float(r) for r in args.rates.split(",")]:
            for model in args.models.split(","):
                key = f"{nodes}x{per} {rate:g}Mbit {model}"
                runs = []
                for seed in [int(s) for s in args.seeds.split(",")]:
                    print(f"{key} seed {seed} ...", flush=True)
                    run = run_job(args, nodes, per, rate, model, seed)
                    run["seed"] = seed
                    score(run, args.tolerance, args.loss_tolerance)
                    runs.append(run)
                result["panels"][key] = {"nodes": nodes, "ranks_per_node": per,
                                         "rate_mbit": rate, "model": model, "runs": runs,
                                         "summary": summarize(runs)}
                if args.json:   # partial results survive an interrupted sweep
                    C.write_json(args.json, result)
    return result


def combine(paths: list[str]) -> dict[str, Any]:
    """One result from the JSON files of several runs (e.g. one per shape, each taken
    under the benchmark lock): their panels side by side, the first file's settings."""
    result: dict[str, Any] | None = None
    for path in paths:
        with open(path) as fh:
            part = json.load(fh)
        if result is None:
            result = part
            result["combined_from"] = []
        else:
            result["panels"].update(part["panels"])
        result["combined_from"].append(os.path.basename(path))
    if result is None:
        raise SystemExit("--combine: no files given")
    return result


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
    """The summary tables as Markdown (for benchmarks/README.md)."""
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
        print(f"\n{key} ({emulation}); target (median over seeds) "
              f"{panel['summary']['_target_acc']:.4f}")
        print(table(panel))


def plot(result: dict[str, Any], path: str) -> None:
    """Accuracy (worst replica) against wall time, one panel per shape/rate/model; the
    first seed's curves, the target dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = list(result["panels"].items())
    cols = min(2, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.5 * rows), squeeze=False)
    for ax, (key, panel) in zip(axes.flat, panels):
        run = panel["runs"][0]
        for name, r in run["contenders"].items():
            style = ":" if name == CONTROL else ("--" if name in PEERS else "-")
            ax.plot([p["wall_s"] for p in r["curve"]], [p["acc_worst"] for p in r["curve"]],
                    style, marker=".", markersize=3, label=name)
        if run.get("target_acc") is not None:
            ax.axhline(run["target_acc"], color="gray", linestyle="--", linewidth=0.8)
        if panel.get("model") == "gpt":
            ax.set(ylabel="minus validation loss, nats/byte (worst replica)")
        else:
            ax.set(ylim=(0.0, 1.0), ylabel="test accuracy (worst replica)")
        ax.set(xscale="log", xlabel="wall time, evaluation excluded (s)",
               title=f"{key}, seed {run['seed']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 2x1 at 1000 Mbit/s, CNN, gradient_allreduce and "
                        "local_sgd, torch DDP and the control, 3 epochs, one seed")
    p.add_argument("--shapes", default="2x2,4x1", help="NODESxRANKS, comma-separated")
    p.add_argument("--rates", default="1000", help="inter-node Mbit/s, comma-separated; 0: none")
    p.add_argument("--delay-ms", type=float, default=0.5)
    p.add_argument("--models", default="cnn,mlp")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--algorithms", default=",".join(CONTENDERS))
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="SGD rate; Adam-family: lr / 10")
    p.add_argument("--width", type=int, default=512, help="hidden width of the mlp model")
    p.add_argument("--eval-every", type=int, default=4, help="steps between evaluations")
    p.add_argument("--tolerance", type=float, default=0.005,
                   help="target = sync final accuracy minus this (fraction; 0.005 = 0.5 pp)")
    p.add_argument("--loss-tolerance", type=float, default=0.01,
                   help="GPT target = sync final validation loss times 1 + this")
    p.add_argument("--gpt-size", default="small", choices=("default", "small", "tiny"),
                   help="GPT size (benchmarks/gpt.py): default 1.85 M, small 1.05 M params")
    p.add_argument("--gpt-steps-per-epoch", type=int, default=16)
    p.add_argument("--gpt-lr", type=float, default=3e-3, help="AdamW rate (qadam: / 10)")
    p.add_argument("--gpt-bytes", type=int, default=None, help="cut the corpus' sides")
    p.add_argument("--gpt-eval-windows", type=int, default=32)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--markdown", default=None, help="also write the tables as Markdown")
    p.add_argument("--combine", default=None, metavar="A.json,B.json",
                   help="no runs: merge the panels of earlier --json files, report, plot")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--model", default="cnn", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in args.algorithms.split(","):
        if name not in CONTENDERS:
            p.error(f"--algorithms: unknown contender {name!r} (known: {', '.join(CONTENDERS)})")
    if args.quick:
        args.shapes, args.rates, args.models, args.seeds = "2x1", "1000", "cnn", "0"
        args.algorithms = f"{SYNC},local_sgd,{PEER},{CONTROL}"
        args.epochs = 3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.json = args.json or str(C.RESULTS_DIR / "time_to_accuracy_quick.json")
        args.plot = args.plot or str(C.RESULTS_DIR / "time_to_accuracy_quick.png")
    if args.combine:
        result = combine(args.combine.split(","))
    else:
        result = drive(args)
    report(result)
    if args.json:
        C.write_json(args.json, result)
        print(f"JSON: {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"plot: {args.plot}")
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(markdown(result))
        print(f"markdown: {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
