"""Train a DLRM-style click-through-rate model: sparse features through a sharded
``commlib.ShardedEmbeddingBag``, the dense MLPs through ``commlib.DistributedDataParallel``.

    mpiexec -n 4 python -m commlib.examples.train_ctr
    mpiexec -n 4 python -m commlib.examples.train_ctr --staleness 4
    mpiexec -n 4 python -m commlib.examples.train_ctr --cache-rows 2000 --pull-bound 10
    mpiexec -n 4 python -m commlib.examples.train_ctr --lookahead 4 --algorithm bytegrad

The click log is synthetic and shipped as a generator: ``--features`` categorical features
whose ids follow a Zipf law over ``--rows`` rows in all (a few hot ids take most lookups),
plus a few dense features; labels are drawn from a known logistic teacher (a hashed weight
per id, a linear dense part), so the teacher's own AUC on the test set is the ceiling. Each
batch is generated from (seed, batch index, rank): nothing is stored, any size works. The
job ends with the test AUC (``sklearn.metrics.roc_auc_score``), samples/s and the bytes
this rank handed to MPI per step (``commlib.stats()``). ``--replicated`` trains the naive
baseline instead: a replicated ``nn.EmbeddingBag`` under torch DDP over gloo.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

import commlib


# -- the synthetic click log ------------------------------------------------------------------
class ClickLog:
    """Deterministic Zipf click log: ``batch(index, rank, size)`` -> (ids (B, F) int64 global
    table rows, dense (B, d) float, label (B,) float, teacher probability (B,))."""

    def __init__(self, rows: int, features: int, dense: int = 4, zipf: float = 1.1,
                 seed: int = 0) -> None:
        if rows < features:
            raise ValueError(f"train_ctr: --rows ({rows}) must be at least --features "
                             f"({features})")
        self.features, self.dense, self.seed = features, dense, seed
        self.vocab = [rows // features + (f < rows % features) for f in range(features)]
        self.offset = np.concatenate([[0], np.cumsum(self.vocab)[:-1]]).astype(np.int64)
        self.cdf = []
        for v in sorted(set(self.vocab)):
            p = 1.0 / np.arange(1, v + 1, dtype=np.float64) ** zipf
            self.cdf.append((v, np.cumsum(p / p.sum())))
        self.cdf = dict(self.cdf)
        rng = np.random.default_rng(seed + 10_000)
        self.w_dense = rng.normal(0, 0.5, dense)
        self.scale = 1.5

    def _teacher_id(self, ids: np.ndarray) -> np.ndarray:
        """A fixed pseudo-random weight in [-1, 1) per table row (a hash, no table)."""
        x = (ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(self.seed)) \
            & np.uint64((1 << 64) - 1)
        x ^= x >> np.uint64(31)
        return (x % np.uint64(1 << 20)).astype(np.float64) / (1 << 19) - 1.0

    def batch(self, index: int, rank: int, size: int, split: str = "train"):
        rng = np.random.default_rng([self.seed, index, rank, 0 if split == "train" else 1])
        ids = np.empty((size, self.features), dtype=np.int64)
        for f, v in enumerate(self.vocab):
            ids[:, f] = self.offset[f] + np.searchsorted(self.cdf[v], rng.random(size))
        ids = np.minimum(ids, self.offset + np.array(self.vocab) - 1)
        dense = rng.normal(0, 1, (size, self.dense))
        logit = self.scale * self._teacher_id(ids).sum(1) / np.sqrt(self.features) \
            + dense @ self.w_dense - 0.5
        prob = 1 / (1 + np.exp(-logit))
        label = (rng.random(size) < prob).astype(np.float64)
        return (torch.from_numpy(ids), torch.from_numpy(dense).float(),
                torch.from_numpy(label).float(), prob)


# -- the model --------------------------------------------------------------------------------
class DLRM(nn.Module):
    """Bottom MLP on dense features, one embedding per sparse feature (one shared table,
    feature ``f`` at its own row offset), pairwise dot interactions, top MLP -> logit."""

    def __init__(self, emb: nn.Module, features: int, dense: int, dim: int) -> None:
        super().__init__()
        self.emb, self.features, self.dim = emb, features, dim
        self.bottom = nn.Sequential(nn.Linear(dense, 32), nn.ReLU(), nn.Linear(32, dim))
        pairs = (features + 1) * features // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        b = ids.shape[0]
        x = self.bottom(dense)
        e = self.emb(ids.reshape(-1, 1)).reshape(b, self.features, self.dim)
        z = torch.cat([x.unsqueeze(1), e], 1)
        inter = torch.bmm(z, z.transpose(1, 2))
        i, j = torch.triu_indices(self.features + 1, self.features + 1, 1)
        return self.top(torch.cat([x, inter[:, i, j]], 1)).squeeze(1)


def gloo_world() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        return
    port = np.zeros(1, dtype=np.int64)
    if commlib.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    commlib.broadcast(port, 0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port[0])}",
                            rank=commlib.get_rank(), world_size=commlib.get_world_size())


def build(args: argparse.Namespace, log: ClickLog) -> tuple[nn.Module, nn.Module, Any]:
    """(the wrapped model, the embedding module, the dense optimizer)."""
    rows = sum(log.vocab)
    torch.manual_seed(args.seed)
    if args.replicated:
        import torch.distributed as dist
        gloo_world()
        emb = nn.EmbeddingBag(rows, args.dim, mode="sum")
        with torch.no_grad():
            emb.weight.normal_(0, 0.05)
        model = DLRM(emb, args.features, log.dense, args.dim)
        wrapped = nn.parallel.DistributedDataParallel(model, process_group=dist.group.WORLD)
        opt = torch.optim.Adagrad([{"params": model.emb.parameters(), "lr": args.emb_lr},
                                   {"params": list(model.bottom.parameters())
                                    + list(model.top.parameters())}], lr=args.lr)
        return wrapped, emb, opt
    cache = None
    if args.cache_rows:
        cache = commlib.EmbeddingCache(args.cache_rows, policy=args.policy,
                                       pull_bound=args.pull_bound, push_bound=args.push_bound)
    emb = commlib.ShardedEmbeddingBag(rows, args.dim, mode="sum", optimizer=args.emb_optimizer,
                                      lr=args.emb_lr, staleness=args.staleness, cache=cache)
    gen = torch.Generator().manual_seed(args.seed + commlib.get_rank())
    with torch.no_grad():
        emb.local_weight.normal_(0, 0.05, generator=gen)
    model = DLRM(emb, args.features, log.dense, args.dim)
    wrapped = commlib.DistributedDataParallel(model, algorithm=args.algorithm)
    opt = torch.optim.Adagrad(wrapped.parameters(), lr=args.lr)
    return wrapped, emb, opt


def batches(log: ClickLog, args: argparse.Namespace) -> Iterator[tuple]:
    rank = commlib.get_rank()
    for step in range(args.steps):
        ids, dense, label, _ = log.batch(step, rank, args.batch)
        yield ids, dense, label


def evaluate(model: nn.Module, log: ClickLog, args: argparse.Namespace) -> tuple[float, float]:
    """(model AUC, teacher AUC) on the same test set on every rank."""
    from sklearn.metrics import roc_auc_score
    scores, labels, probs = [], [], []
    model.eval()
    with torch.no_grad():
        for k in range(max(1, args.test_samples // 1024)):
            ids, dense, label, prob = log.batch(k, 0, 1024, split="test")
            scores.append(model(ids, dense).numpy())
            labels.append(label.numpy())
            probs.append(prob)
    model.train()
    y = np.concatenate(labels)
    return float(roc_auc_score(y, np.concatenate(scores))), \
        float(roc_auc_score(y, np.concatenate(probs)))


def total_bytes() -> int:
    return sum(v["bytes"] for v in commlib.stats().values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000, help="embedding rows in all")
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=256, help="samples per rank and step")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--lr", type=float, default=0.05, help="dense Adagrad learning rate")
    p.add_argument("--emb-lr", type=float, default=0.05)
    p.add_argument("--emb-optimizer", default="adagrad", choices=["sgd", "adagrad", "adam"])
    p.add_argument("--algorithm", default="gradient_allreduce", help="dense DDP algorithm")
    p.add_argument("--staleness", type=int, default=0, help="Persia's tau")
    p.add_argument("--cache-rows", type=int, default=0, help="HET cache rows (0: none)")
    p.add_argument("--pull-bound", type=int, default=0)
    p.add_argument("--push-bound", type=int, default=0)
    p.add_argument("--policy", default="lru", choices=["lru", "lfu"])
    p.add_argument("--lookahead", type=int, default=0, help="Bagpipe's L (0: none)")
    p.add_argument("--replicated", action="store_true",
                   help="baseline: replicated nn.EmbeddingBag under torch DDP over gloo")
    p.add_argument("--test-samples", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results (rank 0) here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    commlib.init()
    rank, n = commlib.get_rank(), commlib.get_world_size()
    log = ClickLog(args.rows, args.features, zipf=args.zipf, seed=args.seed)
    model, emb, opt = build(args, log)
    loader: Any = batches(log, args)
    if args.staleness and not args.replicated:
        loader = commlib.embedding.PrefetchLoader(loader, [emb],
                                                  lambda b: [b[0].reshape(-1, 1)])
    elif args.lookahead and not args.replicated:
        loader = commlib.LookaheadLoader(loader, [emb], lambda b: [b[0].reshape(-1, 1)],
                                         lookahead=args.lookahead)
    loss_fn = nn.BCEWithLogitsLoss()
    bytes0, start, losses = total_bytes(), time.perf_counter(), []
    for step, (ids, dense, label) in enumerate(loader):
        opt.zero_grad()
        loss = loss_fn(model(ids, dense), label)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if rank == 0 and (step + 1) % max(1, args.steps // 5) == 0:
            print(f"step {step + 1}/{args.steps} loss {np.mean(losses[-20:]):.4f}", flush=True)
    if not args.replicated:
        emb.flush()
    seconds = time.perf_counter() - start
    bytes_per_step = (total_bytes() - bytes0) / max(1, args.steps)
    if args.replicated:  # torch DDP over gloo: every gradient, all-reduced each step
        bytes_per_step = sum(p.numel() * p.element_size() for p in model.parameters())
    auc, ceiling = evaluate(model, log, args)
    result = {"samples_per_s": args.steps * args.batch * n / seconds,
              "bytes_per_step": bytes_per_step, "auc": auc, "teacher_auc": ceiling,
              "final_loss": float(np.mean(losses[-20:])), "ranks": n, "seconds": seconds}
    if rank == 0:
        print(f"test AUC {auc:.4f} (teacher {ceiling:.4f}), {result['samples_per_s']:.0f} "
              f"samples/s, {bytes_per_step / 1e6:.3f} MB/step handed to MPI by rank 0",
              flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), **result}, f, indent=1)
    if not args.replicated:
        emb.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
