"""The steady-state cost of ZeRO stage 1 in elastic training (:mod:`commlib.elastic.zero`):
each step's commit copies this rank's model and optimizer shard and sends the shard to the
next rank. Against ZeRO-1 without elastic training, in one job, the same model, optimizer
and wrapper, blocks of steps interleaved (with and without ``state.commit()``).

    mpiexec -n 2 python benchmarks/bench_elastic_zero.py [--width 1024 --depth 4 --json out.json]

fp32 Adam on a WideMLP (``depth`` x ``width``^2 parameters), ``commlib.ZeroRedundancyOptimizer``
behind ``state.wrap(algorithm="gradient_allreduce")``. Reported per step (median over
``--reps`` blocks of ``--steps`` steps, the slowest rank's block time): the time of a step
without the commit, with it, and of the commit alone; the bytes commlib counted (bus bytes
of the collectives, ``commlib.stats()``) and the replica's bytes (one shard's state sent
point to point, ``State.replica_bytes``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import commlib  # noqa: E402
from commlib import elastic  # noqa: E402
from models import WideMLP  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    commlib.init()
    torch.set_num_threads(1)
    rank, n = commlib.get_rank(), commlib.get_world_size()
    torch.manual_seed(0)
    model = WideMLP(width=args.width, depth=args.depth)
    params = sum(p.numel() for p in model.parameters())
    zero = commlib.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                           lr=1e-4)
    state = elastic.State(model, zero)
    ddp = state.wrap(algorithm="gradient_allreduce")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 784, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    commit_s: list[float] = []

    def step(commit: bool) -> None:
        F.cross_entropy(ddp(x), y).backward()
        zero.step()
        zero.zero_grad(set_to_none=True)
        if commit:
            t0 = time.perf_counter()
            state.commit()
            commit_s.append(time.perf_counter() - t0)

    for commit in (False, True, False, True):  # warm-up (Adam's state, the first commit)
        step(commit)
    blocks: dict[bool, list[float]] = {False: [], True: []}
    bus: dict[bool, int] = {}
    for _ in range(args.reps):
        for commit in (False, True):
            commlib.barrier()
            commlib.stats(reset=True)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(commit)
            mine = (time.perf_counter() - t0) / args.steps
            snapshot = commlib.stats(reset=True)
            bus[commit] = sum(v["bus_bytes"] for v in snapshot.values()) // args.steps
            slowest = commlib.allreduce(torch.tensor([mine], dtype=torch.float64),
                                        op=commlib.ReduceOp.MAX)
            blocks[commit].append(float(slowest[0]))
    plain, with_commit = statistics.median(blocks[False]), statistics.median(blocks[True])
    commit_med = statistics.median(commit_s[-args.reps * args.steps:])
    result = {"params": params, "ranks": n, "shard_elements": zero.shard_numel[rank],
              "replica_bytes": state.replica_bytes,
              "bus_bytes_per_step_plain": bus[False],
              "bus_bytes_per_step_elastic": bus[True],
              "step_s_plain": plain, "step_s_elastic": with_commit,
              "commit_s": commit_med, "time_ratio": with_commit / plain,
              "replica_to_step_bytes": state.replica_bytes / max(1, bus[False]),
              "blocks": {"plain": blocks[False], "elastic": blocks[True]},
              "environment": C.environment(n)}
    if rank == 0:
        print(f"ZeRO-1 Adam fp32, {params / 1e6:.2f} M parameters, {n} ranks: step "
              f"{plain * 1e3:.1f} ms without elastic, {with_commit * 1e3:.1f} ms with the "
              f"commit (x{with_commit / plain:.3f}; the commit alone {commit_med * 1e3:.1f} "
              f"ms); replica {state.replica_bytes / 2**20:.2f} MiB a step against "
              f"{bus[False] / 2**20:.2f} MiB of ZeRO's collectives (bus bytes; "
              f"{state.replica_bytes / max(1, bus[False]):.3f}x)")
        if args.json:
            C.write_json(args.json, result)


if __name__ == "__main__":
    main()
