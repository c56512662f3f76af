"""Train a model that does not fit one rank's memory budget unless it is sharded.

    mpiexec -n 4 python -m commlib.examples.train_large --budget-mib 40 --sharding FULL_SHARD
    mpiexec -n 4 python -m commlib.examples.train_large --budget-mib 40 --sharding NO_SHARD

A wide MLP (default 3.2 M float32 parameters: 51 MiB of parameters, gradients and Adam
state when replicated, ZeRO's 16 bytes per parameter) is trained on scikit-learn's digits
under a per-rank budget for training state. Before anything is allocated, the ZeRO formula
of the chosen strategy (DDP and NO_SHARD 16 psi, SHARD_GRAD_OP 4 psi + 12 psi / N,
FULL_SHARD 16 psi / N plus one gathered chunk) says whether the model should fit (the
prefetch of the next chunk and the re-gather for backward hold up to three chunks at once,
which the measurement shows); while
training, the bytes this rank really holds (parameters and gathered chunks, gradients,
optimizer state; the most gathered FULL_SHARD chunks held at any moment) are measured after
every step and the run stops with exit status 3 on every rank the moment they exceed the
budget. Rank 0 prints a table of the budget, the formula and the measured bytes, and the
test accuracy at the end.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import commlib
from commlib.examples.train_digits import load_digits_split

#: Exit status of a run whose training state exceeded the budget.
OVER_BUDGET = 3
MIB = 1 << 20
STRATEGIES = ("DDP", "NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")


def wide_mlp(width: int, depth: int) -> nn.Sequential:
    """64 inputs (8x8 digits), ``depth`` hidden layers of ``width``, 10 classes."""
    layers: list[nn.Module] = []
    d = 64
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, 10))
    return nn.Sequential(*layers)


def formula_bytes(strategy: str, psi: int, n: int, chunk_bytes: int) -> float:
    """ZeRO's bytes per rank for fp32 Adam (4 parameter, 4 gradient, 8 state bytes)."""
    return {"DDP": 16 * psi, "NO_SHARD": 16 * psi, "SHARD_GRAD_OP": 4 * psi + 12 * psi / n,
            "FULL_SHARD": 16 * psi / n + chunk_bytes}[strategy]


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def held_bytes(model: nn.Module, opt: torch.optim.Optimizer, strategy: str) -> dict[str, int]:
    """What this rank holds now (parameters, gradients, optimizer state, peak gathered)."""
    if strategy == "DDP":
        params = list(model.parameters())
        got = {"params": sum(p.numel() * p.element_size() for p in params),
               "grads": sum(p.grad.numel() * p.grad.element_size() for p in params
                            if p.grad is not None), "peak_gathered": 0}
    else:
        got = model.memory_bytes(reset_peak=True)
    got["optim"] = state_bytes(opt)
    # FULL_SHARD frees gathered chunks after use: their peak is what the step needed on
    # top of the shards it keeps; other strategies hold their chunks (already in params).
    working = got["peak_gathered"] if strategy == "FULL_SHARD" else 0
    got["total"] = got["params"] + got["grads"] + got["optim"] + working
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-mib", type=float, default=40.0,
                   help="per-rank budget for parameters, gradients and optimizer state")
    p.add_argument("--sharding", choices=STRATEGIES, default="FULL_SHARD",
                   help="DDP (commlib.DistributedDataParallel) or a FullyShardedDataParallel "
                        "strategy (default: FULL_SHARD)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--chunk-mib", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rank, n = commlib.get_rank(), commlib.get_world_size()
    budget = args.budget_mib * MIB

    torch.manual_seed(0)
    model = wide_mlp(args.width, args.depth)
    psi = sum(p.numel() for p in model.parameters())
    predicted = formula_bytes(args.sharding, psi, n, int(args.chunk_mib * MIB))
    if rank == 0:
        print(f"wide MLP {psi / 1e6:.2f} M parameters (fp32, Adam) on {n} ranks, "
              f"{args.sharding}: ZeRO formula {predicted / MIB:.1f} MiB per rank, budget "
              f"{args.budget_mib:.1f} MiB: {'fits' if predicted <= budget else 'does not fit'}",
              flush=True)
    if args.sharding == "DDP":
        net: nn.Module = commlib.DistributedDataParallel(model)
    else:
        net = commlib.FullyShardedDataParallel(model, args.sharding,
                                               chunk_size_mb=args.chunk_mib)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    train, test = load_digits_split()
    x_all, y_all = train.tensors
    x_all = x_all.flatten(1)
    g = torch.Generator().manual_seed(1)
    peak: dict[str, int] = {}
    for step in range(args.steps):
        idx = torch.randint(0, len(x_all), (n, args.batch), generator=g)[rank]
        opt.zero_grad()
        F.cross_entropy(net(x_all[idx]), y_all[idx]).backward()
        opt.step()
        held = held_bytes(net, opt, args.sharding)
        if held["total"] > peak.get("total", -1):
            peak = held
        worst = float(commlib.allreduce(np.array([held["total"]], dtype=np.float64),
                                        op="max")[0])
        if worst > budget:
            if rank == 0:
                print(f"step {step}: training state {worst / MIB:.1f} MiB on the fullest rank "
                      f"exceeds the budget of {args.budget_mib:.1f} MiB: stopping "
                      f"(exit status {OVER_BUDGET})", flush=True)
            return OVER_BUDGET
    x_test, y_test = test.tensors
    with torch.no_grad():
        correct = (net(x_test.flatten(1)).argmax(1) == y_test).sum().item()
    if rank == 0:
        print("| budget | ZeRO formula | params held | grads | optimizer state | "
              "peak gathered | total (peak step) |")
        print("|---|---|---|---|---|---|---|")
        print(f"| {args.budget_mib:.1f} MiB | {predicted / MIB:.1f} MiB | "
              f"{peak['params'] / MIB:.1f} MiB | {peak['grads'] / MIB:.1f} MiB | "
              f"{peak['optim'] / MIB:.1f} MiB | {peak['peak_gathered'] / MIB:.1f} MiB | "
              f"{peak['total'] / MIB:.1f} MiB |")
        print(f"within budget for {args.steps} steps; test accuracy "
              f"{correct / len(y_test):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
