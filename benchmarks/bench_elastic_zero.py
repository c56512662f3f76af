"""The steady-state cost of elastic training's commit (:mod:`commlib.elastic`): with ZeRO
stage 1 (:mod:`commlib.elastic.zero`) each commit copies this rank's model and optimizer
shard and sends the shard to the next rank; plain data parallelism (``--optimizer adam``)
copies nothing. Against the same training without the commit, in one job, the same model,
optimizer and wrapper, blocks of steps interleaved (with and without ``state.commit()``).

    mpiexec -n 2 python benchmarks/bench_elastic_zero.py [--width 1024 --depth 4 --json out.json]
        [--optimizer zero|adam] [--commit-every K]

fp32 Adam on a WideMLP (``depth`` x ``width``^2 parameters), ``commlib.ZeroRedundancyOptimizer``
(or torch's Adam) behind ``state.wrap(algorithm="gradient_allreduce")``. Reported per step
(median over ``--reps`` blocks of ``--steps`` steps, the slowest rank's block time; a block
with commits includes waiting for its last replica): the time of a step without the
commit, with it, and of the commit call alone; the bytes commlib counted (bus bytes of the
collectives and the point-to-point bytes, ``commlib.stats()``), the replica's bytes (one
shard's state, ``State.replica_bytes``), what the commits hold (``commit_bytes_held``) and,
per rank, the time spent in the commit's parts (``commit_parts_s_per_step``: the model's
copy, the shard's copy, the layouts' exchange, the wait for the replica before the next
optimizer step).
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
from commlib.elastic import commits as elastic_commits  # noqa: E402
from commlib.elastic import state as elastic_state  # noqa: E402
from commlib.elastic import zero as zero_elastic  # noqa: E402
from commlib.elastic.commit_buffers import Flat  # noqa: E402
from models import WideMLP  # noqa: E402


class Timers:
    """Time spent in the parts of a commit (wrapping the functions that do them)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.on = False

    def wrap(self, owner: object, name: str, part: str) -> None:
        original = getattr(owner, name)

        def timed(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if self.on:
                    self.spent[part] = self.spent.get(part, 0.0) + time.perf_counter() - t0
        setattr(owner, name, timed)


def held_bytes(state: elastic.State) -> int:
    """Bytes of the tensors the commits hold (model copies, shard copies, replicas)."""
    seen: set[int] = set()

    def walk(tree: object) -> int:
        if isinstance(tree, torch.Tensor):
            key = tree.untyped_storage().data_ptr()
            if key in seen:
                return 0
            seen.add(key)
            return tree.untyped_storage().nbytes()
        if isinstance(tree, dict):
            return sum(walk(v) for v in tree.values())
        if isinstance(tree, (list, tuple)):
            return sum(walk(v) for v in tree)
        if isinstance(tree, Flat):
            return walk(tree.data)
        return 0
    return sum(walk(c.model) + walk(c.optimizer) for c in state._commits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--optimizer", choices=["zero", "adam"], default="zero",
                    help="zero: ZeroRedundancyOptimizer(Adam); adam: torch's Adam (plain "
                         "elastic data parallelism)")
    ap.add_argument("--commit-every", type=int, default=1,
                    help="State(commit_every=...): a commit every k steps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    commlib.init()
    torch.set_num_threads(1)
    rank, n = commlib.get_rank(), commlib.get_world_size()
    torch.manual_seed(0)
    model = WideMLP(width=args.width, depth=args.depth)
    params = sum(p.numel() for p in model.parameters())
    zero_opt = args.optimizer == "zero"
    if zero_opt:
        opt = commlib.ZeroRedundancyOptimizer(model.parameters(),
                                              optimizer_class=torch.optim.Adam, lr=1e-4)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    state = elastic.State(model, opt, commit_every=args.commit_every)
    ddp = state.wrap(algorithm="gradient_allreduce")
    timers = Timers()
    timers.wrap(elastic_commits, "copy_tree", "model_and_optimizer_copy")
    if zero_opt:
        timers.wrap(elastic_state.zero_elastic, "commit", "shard_commit")
        timers.wrap(Flat, "fill", "shard_copy")
        timers.wrap(zero_elastic, "sendrecv", "replica_header")
        timers.wrap(zero_elastic.Ring, "wait", "replica_wait")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 784, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    commit_s: list[float] = []

    def step(commit: bool) -> None:
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if commit:
            t0 = time.perf_counter()
            state.commit()
            commit_s.append(time.perf_counter() - t0)

    for commit in (False, True, False, True, True, True):  # warm-up (Adam's state, commits)
        step(commit)
    blocks: dict[bool, list[float]] = {False: [], True: []}
    bus: dict[bool, int] = {}
    for _ in range(args.reps):
        for commit in (False, True):
            state._settle()  # (the last exchange of the block before, not timed)
            commlib.barrier()
            commlib.stats(reset=True)
            timers.on = commit
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(commit)
            if commit:
                state._settle()  # the block's last replica exchange, in its time
            mine = (time.perf_counter() - t0) / args.steps
            timers.on = False
            snapshot = commlib.stats(reset=True)
            bus[commit] = sum(v["bus_bytes"] for v in snapshot.values()) // args.steps
            slowest = commlib.allreduce(torch.tensor([mine], dtype=torch.float64),
                                        op=commlib.ReduceOp.MAX)
            blocks[commit].append(float(slowest[0]))
    plain, with_commit = statistics.median(blocks[False]), statistics.median(blocks[True])
    commit_med = statistics.median(commit_s[-args.reps * args.steps:])
    parts = {k: v / (args.reps * args.steps) for k, v in sorted(timers.spent.items())}
    every = commlib.allgather(torch.tensor([parts.get(k, 0.0) for k in sorted(parts)],
                                           dtype=torch.float64))
    held = held_bytes(state)
    result = {"optimizer": args.optimizer, "params": params, "ranks": n,
              "commit_every": args.commit_every, "batch": args.batch,
              "shard_elements": zero_opt and opt.shard_numel[rank],
              "replica_bytes": state.replica_bytes,
              "commit_bytes_held": held,
              "bus_bytes_per_step_plain": bus[False],
              "bus_bytes_per_step_elastic": bus[True],
              "step_s_plain": plain, "step_s_elastic": with_commit,
              "commit_s": commit_med, "time_ratio": with_commit / plain,
              "replica_to_step_bytes": state.replica_bytes / max(1, bus[False]),
              "commit_parts_s_per_step": {k: [float(v) for v in every.reshape(n, -1)[:, i]]
                                          for i, k in enumerate(sorted(parts))},
              "blocks": {"plain": blocks[False], "elastic": blocks[True]},
              "environment": C.environment(n)}
    if rank == 0:
        what = "ZeRO-1" if zero_opt else "DDP"
        print(f"{what} Adam fp32, {params / 1e6:.2f} M parameters, {n} ranks: step "
              f"{plain * 1e3:.2f} ms without elastic, {with_commit * 1e3:.2f} ms with the "
              f"commit (x{with_commit / plain:.3f}; the commit call alone "
              f"{commit_med * 1e3:.2f} ms); replica {state.replica_bytes / 2**20:.2f} MiB "
              f"a step against {bus[False] / 2**20:.2f} MiB of the collectives (bus bytes;"
              f" {state.replica_bytes / max(1, bus[False]):.3f}x); the commits hold "
              f"{held / 2**20:.1f} MiB")
        for k, v in result["commit_parts_s_per_step"].items():
            print(f"  {k}: " + " ".join(f"{x * 1e3:.2f}" for x in v) + " ms a step (per rank)")
        if args.json:
            C.write_json(args.json, result)


if __name__ == "__main__":
    main()
