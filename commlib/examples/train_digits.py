"""Train a small CNN on scikit-learn's 8x8 handwritten digits with commlib's DDP.

    mpiexec -n 4 python -m commlib.examples.train_digits --algorithm gradient_allreduce

Each rank trains on its shard of the training set (a distributed sampler); rank 0 shows a
progress bar and, per epoch, the global mean loss, training accuracy and samples/s; the
job ends with the test accuracy. The data set ships inside scikit-learn: nothing is
downloaded. Algorithm options are passed as ``--algo-arg key=value`` (values parsed as
Python literals), e.g. ``--algorithm gradient_allreduce --algo-arg hierarchical=True`` or
``--algo-arg comm_dtype=bf16``. ``--sharding FULL_SHARD`` (or ``SHARD_GRAD_OP``,
``NO_SHARD``) trains with ``commlib.FullyShardedDataParallel`` instead; ``--sharding ZERO1``
keeps DDP and shards the optimizer state with ``commlib.ZeroRedundancyOptimizer``.
``--sync-bn`` turns the batch-norm layers into :class:`commlib.nn.SyncBatchNorm` (statistics over all ranks' batches);
``--timeline PATH`` writes a Chrome trace of every collective and bucket exchange per rank
(``PATH.rank{r}.json``) and, on rank 0, the merged ``PATH.json`` (open it in Perfetto).
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import commlib
from commlib.base import accounting
from commlib.primitives import allreduce


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions with batch norm and a linear classifier, for 1x8x8 images."""

    def __init__(self, classes: int = 10, width: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.fc = nn.Linear(2 * width * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "ZERO1")


def load_digits_split(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """80/20 split of the 1797 digits, pixels scaled to [0, 1], the same on every rank."""
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.tensor(data.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def parse_algo_args(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--algo-arg expects key=value, got {pair!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def global_sums(*values: float) -> np.ndarray:
    """Sum of each value over all ranks (float64)."""
    return allreduce(np.array(values, dtype=np.float64))


def evaluate(model: nn.Module, data: TensorDataset, rank: int, n: int) -> float:
    """Accuracy over the whole set: each rank scores its shard, counts are summed."""
    model.eval()
    x, y = data.tensors
    with torch.no_grad():
        correct = (model(x[rank::n]).argmax(1) == y[rank::n]).sum().item()
    model.train()
    right, total = global_sums(correct, len(y[rank::n]))
    return right / total


def train_epoch(ddp: nn.Module, loader: DataLoader, opt: torch.optim.Optimizer,
                bar: Any) -> tuple[float, float, int, float]:
    loss_sum, correct, seen = 0.0, 0, 0
    start = time.perf_counter()
    for x, y in loader:
        opt.zero_grad()
        out = ddp(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        loss_sum += loss.item() * len(y)
        correct += (out.argmax(1) == y).sum().item()
        seen += len(y)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    return loss_sum, correct, seen, time.perf_counter() - start


def make_optimizer(args: argparse.Namespace, ddp: nn.Module) -> torch.optim.Optimizer:
    name = args.optimizer or ("qadam" if args.algorithm == "qadam" else "sgd")
    if args.sharding == "ZERO1" and name in ("sgd", "adam"):
        cls, kw = ((torch.optim.SGD, {"lr": args.lr, "momentum": args.momentum})
                   if name == "sgd" else (torch.optim.Adam, {"lr": args.lr / 10}))
        return commlib.ZeroRedundancyOptimizer(ddp.parameters(), cls, **kw)
    if name == "sgd":
        return torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    lr = args.lr / 10  # Adam's steps are normalized: a tenth of SGD's rate
    if name == "adam":
        return torch.optim.Adam(ddp.parameters(), lr=lr)
    from commlib.algorithms.qadam import QAdamOptimizer
    return QAdamOptimizer(ddp.parameters(), lr=lr)


def write_timeline(path: str, rank: int, n: int) -> None:
    """Close every rank's trace, then merge them on rank 0 into ``path.json``."""
    from commlib.services import timeline
    timeline.stop()
    commlib.barrier()
    if rank == 0:
        count = timeline.merge([timeline.rank_path(path, r) for r in range(n)],
                               path + ".json")
        print(f"timeline: {count} events from {n} ranks in {path}.json", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithm", default="gradient_allreduce",
                   help="registered algorithm name (see commlib.algorithms.available())")
    p.add_argument("--algo-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument of the algorithm (repeatable)")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--optimizer", choices=("sgd", "adam", "qadam"), default=None,
                   help="default: qadam's own optimizer for --algorithm qadam, else sgd")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--sync-bn", action="store_true",
                   help="batch-norm statistics over all ranks (commlib.nn.SyncBatchNorm)")
    p.add_argument("--timeline", metavar="PATH", default=None,
                   help="write a Chrome trace per rank (PATH.rankR.json) and the merged "
                        "PATH.json (open in https://ui.perfetto.dev)")
    p.add_argument("--sharding", choices=SHARDING, default=None,
                   help="FULL_SHARD / SHARD_GRAD_OP / NO_SHARD: FullyShardedDataParallel "
                        "(ZeRO-3 / ZeRO-2 / plain); ZERO1: DDP with ZeroRedundancyOptimizer")
    args = p.parse_args(argv)
    if args.sharding not in (None, "ZERO1") and (args.algorithm != "gradient_allreduce"
                                                 or args.optimizer == "qadam"):
        p.error("--sharding FULL_SHARD/SHARD_GRAD_OP/NO_SHARD replaces DDP's algorithm: "
                "use it without --algorithm and --optimizer qadam")

    if args.timeline:
        commlib.options.timeline = args.timeline  # commlib.init() starts the trace
    commlib.init()
    rank, n = commlib.get_rank(), commlib.get_world_size()
    # Ranks share the node's cores: one intra-op thread each unless cores are plentiful.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // commlib.get_local_size()))
    torch.manual_seed(args.seed)
    train_set, test_set = load_digits_split(args.seed)
    sampler = DistributedSampler(train_set, num_replicas=n, rank=rank, shuffle=True,
                                 seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    model: nn.Module = DigitsCNN()
    if args.sync_bn:
        model = commlib.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    fsdp = args.sharding not in (None, "ZERO1")
    if fsdp:
        ddp = commlib.FullyShardedDataParallel(model, args.sharding)
    else:
        ddp = commlib.DistributedDataParallel(model, algorithm=args.algorithm,
                                              bucket_cap_mb=args.bucket_cap_mb,
                                              **parse_algo_args(args.algo_arg))
    opt = make_optimizer(args, ddp)
    if rank == 0:
        how = f"sharding {args.sharding}" if fsdp else f"algorithm {ddp.algorithm!r}"
        how += ", ZeroRedundancyOptimizer" if args.sharding == "ZERO1" else ""
        print(f"commlib {commlib.__version__}: {n} ranks, {how}, "
              f"{len(train_set)} training / {len(test_set)} test digits", flush=True)
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=args.epochs * len(loader), unit="step", file=sys.stdout)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        loss_sum, correct, seen, seconds = train_epoch(ddp, loader, opt, bar)
        total_loss, total_correct, total_seen = global_sums(loss_sum, correct, seen)
        slowest = -allreduce(np.array([-seconds]), op="min")[0]
        if rank == 0:
            line = (f"epoch {epoch + 1:>2}/{args.epochs}  loss {total_loss / total_seen:.4f}  "
                    f"train acc {total_correct / total_seen:.4f}  "
                    f"{total_seen / slowest:,.0f} samples/s")
            (bar.write(line) if bar is not None else print(line, flush=True))
    if bar is not None:
        bar.close()
    # Decentralized and local algorithms leave replicas that differ: evaluate their average.
    if fsdp:   # the wrapper gathers the sharded parameters for its forward
        accuracy = evaluate(ddp, test_set, rank, n)
    else:
        ddp.average_parameters()
        accuracy = evaluate(ddp.module, test_set, rank, n)
    if rank == 0:
        sent = accounting.total(commlib.stats(), "bytes")
        print(f"test accuracy {accuracy:.4f}  (bytes rank 0 handed to MPI: {sent:,})",
              flush=True)
    ddp.close()
    if args.timeline:
        write_timeline(args.timeline, rank, n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
