"""Sharded data parallelism (ZeRO stages 0-3): memory per rank against the ZeRO formulas,
bytes per step against the allreduce baseline, and step time against torch's
``ZeroRedundancyOptimizer`` and torch FSDP2 (``fully_shard``) over gloo, in one mpiexec job.

    mpiexec -n 2 python benchmarks/bench_zero.py [--width 512 --depth 4 --json out.json]
    mpiexec -n 4 python benchmarks/bench_zero.py --breakdown --steps 20   # where time goes
    mpiexec -n 4 python benchmarks/bench_zero.py --model transformer --batch 1 --chunk-mb 4 \
        --wait both --reps 7 --steps 2   # a pre-LN block stack; spinning vs polling waits

Stages, all fp32 Adam (K = 8 bytes of state per parameter) on the same WideMLP:
  0  commlib.DistributedDataParallel + torch.optim.Adam
  1  commlib.DistributedDataParallel + commlib.ZeroRedundancyOptimizer(Adam), and
     commlib.ZeroRedundancyOptimizer(Adam, reduce_gradients=True) without DDP (gradients
     reduce-scattered in buckets during backward: allreduce's bytes)
  2  commlib.FullyShardedDataParallel(SHARD_GRAD_OP) + Adam over the shards
  3  commlib.FullyShardedDataParallel(FULL_SHARD) + Adam over the shards
Peers: torch DDP + torch ZeroRedundancyOptimizer (stage 1), torch fully_shard with
reshard_after_forward=False (stage 2) and True (stage 3), each Linear a unit, over gloo.

Memory is counted, not sampled: the bytes of the tensors each rank holds between steps
(parameters, gradients, optimizer state; a tensor held twice is counted once), plus, for
FULL_SHARD, the peak of gathered chunks during a step (a gather's receive buffer, one chunk
per request under way, comes on top). ZeRO
formulas for psi parameters (fp32, N ranks): 16 psi, 8 psi + 8 psi/N, 4 psi + 12 psi/N,
16 psi/N. Bytes per step are commlib.stats() bus bytes of one step (per rank). Step times:
median over repetitions of the mean of a block of steps, the slowest rank's, contenders
interleaved block by block.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import commlib  # noqa: E402
from gpt import Block, Config  # noqa: E402  (the GPT workload's pre-LN block)
from models import WideMLP  # noqa: E402


class TransformerStack(torch.nn.Module):
    """``depth`` pre-LN blocks on (batch, seq, d_model) inputs, a final LayerNorm, the mean
    over positions and a 10-class head (the blocks are the units FSDP2 shards)."""

    def __init__(self, d_model: int = 256, heads: int = 4, depth: int = 4,
                 classes: int = 10) -> None:
        super().__init__()
        cfg = Config(d_model=d_model, layers=depth, heads=heads)
        self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(depth))
        self.ln = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x).mean(dim=1))


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    if args.model == "transformer":
        return TransformerStack(args.d_model, args.heads, args.depth)
    return WideMLP(d_in=args.d_in, width=args.width, depth=args.depth)


def fsdp2_units(m: torch.nn.Module) -> list[torch.nn.Module]:
    """What torch's fully_shard wraps before the root: each Linear (WideMLP), each block."""
    if isinstance(m, TransformerStack):
        return list(m.blocks)
    return [layer for layer in m.net if isinstance(layer, torch.nn.Linear)]


def describe(args: argparse.Namespace) -> str:
    if args.model == "transformer":
        return (f"transformer: {args.depth} pre-LN blocks, d_model {args.d_model}, "
                f"{args.heads} heads, seq {args.seq}")
    return f"WideMLP d_in={args.d_in} width={args.width} depth={args.depth}"


def slowest(seconds: float) -> float:
    return float(commlib.allreduce(np.array([seconds]), op="max")[0])


def nbytes(tensors) -> int:
    """Bytes of distinct storages among ``tensors`` (DTensors: their local shard)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def optim_state(opt: torch.optim.Optimizer) -> int:
    return nbytes(v for s in opt.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0)


class Contender:
    def __init__(self, name: str, stage: int, module: Any, opt: Any, memory: Callable,
                 counted: bool = True) -> None:
        self.name, self.stage, self.module, self.opt = name, stage, module, opt
        self.memory, self.counted = memory, counted
        self.times: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad()
        F.cross_entropy(self.module(x), y).backward()
        self.opt.step()


def contenders(args: argparse.Namespace) -> list[Contender]:
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return build_model(args)

    def adam(params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=1e-4)

    out = []
    m = commlib.DistributedDataParallel(model())
    o = adam(m.parameters())
    out.append(Contender("commlib DDP", 0, m, o, lambda m=m, o=o: {
        "params": nbytes(m.parameters()), "grads": nbytes(p.grad for p in m.parameters()),
        "optim": optim_state(o)}))
    from commlib.sharded import groups
    waits = {"auto": [None], "spin": [0.0], "poll": [50e-6], "both": [0.0, 50e-6]}[args.wait]
    for wait in waits:
        # how the sharded wrappers' threads wait for MPI (groups.WAIT_POLL_S; auto: as the
        # communicator chose, option wait_poll_us: poll when a host's ranks outnumber its
        # cores; blocking calls and DDP's thread follow wait_poll_us in every mode)
        groups.WAIT_POLL_S = wait
        tag = "" if len(waits) == 1 else (" [spin]" if wait == 0 else " [poll]")
        m = commlib.DistributedDataParallel(model())
        o = commlib.ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam, lr=1e-4)
        out.append(Contender("commlib DDP+ZeRO-1" + tag, 1, m, o, lambda m=m, o=o: {
            "params": nbytes(m.parameters()), "grads": nbytes(p.grad for p in m.parameters()),
            "optim": optim_state(o.optim)}))
        # stage 1 at allreduce's bytes: no DDP, bucketed reduce-scatter in backward (the local
        # flats of values and gradients, 2 x psi/N, counted with params and grads)
        m = model()
        o = commlib.ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam, lr=1e-4,
                                            reduce_gradients=True)
        out.append(Contender("commlib ZeRO-1 reduce_gradients" + tag, 1, m, o, lambda m=m, o=o: {
            "params": nbytes(list(m.parameters()) + o._values),
            "grads": nbytes([p.grad for p in m.parameters()] + o._grads),
            "optim": optim_state(o.optim)}))
        for stage, strategy in ((2, "SHARD_GRAD_OP"), (3, "FULL_SHARD")):
            m = commlib.FullyShardedDataParallel(model(), strategy, chunk_size_mb=args.chunk_mb)
            o = adam(m.parameters())

            def mem(m=m, o=o) -> dict:
                got = m.memory_bytes(reset_peak=True)
                return {"params": got["params"], "grads": got["grads"], "optim": optim_state(o),
                        "peak_gathered": got["peak_gathered"]}
            out.append(Contender(f"commlib FSDP {strategy}{tag}", stage, m, o, mem))
    groups.WAIT_POLL_S = None
    if "torch" in args.peers:
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
        init_gloo()
        m = torch.nn.parallel.DistributedDataParallel(model())
        o = TorchZero(m.parameters(), torch.optim.Adam, lr=1e-4)
        out.append(Contender("torch DDP+ZeRO (gloo)", 1, m, o, lambda m=m, o=o: {
            "params": nbytes(m.parameters()), "grads": nbytes(p.grad for p in m.parameters()),
            "optim": optim_state(o.optim)}, counted=False))
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for stage, reshard in ((2, False), (3, True)):
            m = model()
            for unit in fsdp2_units(m):
                fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
            o = adam(m.parameters())
            out.append(Contender(f"torch FSDP2 reshard={reshard} (gloo)", stage, m, o,
                                 lambda m=m, o=o: {
                                     "params": nbytes(m.parameters()),
                                     "grads": nbytes(p.grad for p in m.parameters()),
                                     "optim": optim_state(o)}, counted=False))
    return out


def init_gloo() -> None:
    import torch.distributed as dist
    port = np.array([C_free_port() if commlib.get_rank() == 0 else 0])
    commlib.broadcast(port, src=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port[0])}",
                            rank=commlib.get_rank(), world_size=commlib.get_world_size())


def C_free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def formula(stage: int, psi: int, n: int) -> float:
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n,
            3: 16 * psi / n}[stage]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    ap.add_argument("--d-model", type=int, default=256, help="transformer width")
    ap.add_argument("--heads", type=int, default=4, help="transformer heads")
    ap.add_argument("--seq", type=int, default=64, help="transformer sequence length")
    ap.add_argument("--d-in", type=int, default=256)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank")
    ap.add_argument("--chunk-mb", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=5, help="steps per timed block")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-mib", type=float, default=1024.0,
                    help="per-rank memory budget for the largest-model column")
    ap.add_argument("--peers", default="torch", help="'torch' or 'none'")
    ap.add_argument("--wait", choices=("auto", "spin", "poll", "both"), default="auto",
                    help="how the sharded contenders' communication threads wait for MPI "
                         "(commlib.sharded.groups.WAIT_POLL_S); both: each contender twice")
    ap.add_argument("--json", default=None)
    ap.add_argument("--breakdown", action="store_true",
                    help="only the step-time breakdown of each contender (phases, waits, "
                         "hooks, copies, optimizer, MPI; see bench_zero_breakdown.py), "
                         "--steps steps after --warmup")
    ap.add_argument("--zeropp", action="store_true",
                    help="only the ZeRO++ table: FULL_SHARD's bytes per step against "
                         "weight_quantization / gradient_quantization / secondary_shard "
                         "(nodes: COMMLIB_LOCAL_SIZE)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rank, n = commlib.get_rank(), commlib.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x = (torch.randn(args.batch, args.seq, args.d_model, generator=g)
         if args.model == "transformer" else torch.randn(args.batch, args.d_in, generator=g))
    y = torch.randint(0, 10, (args.batch,), generator=g)
    if args.zeropp:
        return zeropp(args, x, y)
    if args.breakdown:
        import bench_zero_breakdown as B
        results = B.run(lambda: contenders(args), x, y, args.warmup, args.steps)
        if rank == 0:
            print(f"\nStep-time breakdown, {describe(args)}, Adam, {n} ranks, batch "
                  f"{args.batch}/rank, chunks "
                  f"{args.chunk_mb} MiB: ms per step, mean over {args.steps} steps and the "
                  f"ranks\n")
            print(B.table(results))
            if args.json:
                C.write_json(args.json, {"env": C.environment(n), "args": vars(args),
                                         "breakdown_ms": results})
        return
    runs = contenders(args)
    psi = sum(p.numel() for p in build_model(args).parameters())
    bus: dict[str, float] = {}
    memory: dict[str, dict] = {}
    for c in runs:
        for _ in range(args.warmup):
            c.step(x, y)
        c.memory()   # resets the peak of gathered chunks: the next step is the one counted
        before = commlib.stats()
        c.step(x, y)
        after = commlib.stats()
        bus[c.name] = sum(v["bus_bytes"] - before.get(op, {}).get("bus_bytes", 0)
                          for op, v in after.items())
        memory[c.name] = c.memory()
    for _ in range(args.reps):
        for c in runs:
            commlib.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                c.step(x, y)
            c.times.append(slowest((time.perf_counter() - t0) / args.steps))
    med = {c.name: statistics.median(c.times) for c in runs}
    if rank != 0:
        return
    base_bus = bus["commlib DDP"]
    print(f"\n{describe(args)}: psi = {psi:,} "
          f"parameters (fp32), Adam, {n} ranks, batch {args.batch}/rank, "
          f"chunks {args.chunk_mb} MiB\n")
    print("| stage | contender | params | grads | optim state | total | ZeRO formula | "
          "total/formula | peak gathered chunks | bus bytes/step vs allreduce | "
          f"largest psi in {args.budget_mib:.0f} MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    mib = 1 << 20
    for c in runs:
        if not c.counted:
            continue
        m = memory[c.name]
        total = m["params"] + m["grads"] + m["optim"]
        f = formula(c.stage, psi, n)
        working = m.get("peak_gathered", 0) if c.stage == 3 else 0
        per_param = total / psi
        largest = (args.budget_mib * mib - working) / per_param
        print(f"| {c.stage} | {c.name} | {m['params'] / mib:.2f} MiB | {m['grads'] / mib:.2f} MiB"
              f" | {m['optim'] / mib:.2f} MiB | {total / mib:.2f} MiB | {f / mib:.2f} MiB | "
              f"{total / f:.3f} | {working / mib:.2f} MiB | {bus[c.name] / base_bus:.2f}x | "
              f"{largest / 1e6:.0f} M |")
    print("\n| stage | contender | step (ms, median) | vs commlib DDP | vs torch peer |")
    print("|---|---|---|---|---|")
    peer = {1: "torch DDP+ZeRO (gloo)", 2: "torch FSDP2 reshard=False (gloo)",
            3: "torch FSDP2 reshard=True (gloo)"}
    for c in runs:
        ratio = (f"{med[c.name] / med[peer[c.stage]]:.2f}x" if c.counted and c.stage in peer
                 and peer[c.stage] in med else "")
        print(f"| {c.stage} | {c.name} | {med[c.name] * 1e3:.1f} | "
              f"{med[c.name] / med['commlib DDP']:.2f}x | {ratio} |")
    if args.json:
        C.write_json(args.json, {"env": C.environment(n), "args": vars(args), "psi": psi,
                                 "memory": memory, "bus_bytes": bus,
                                 "step_s": {c.name: c.times for c in runs}})


ZEROPP = [("FULL_SHARD", {}), ("+ qwZ int8", {"weight_quantization": "int8"}),
          ("+ qgZ int8", {"gradient_quantization": "int8"}),
          ("+ hpZ node", {"secondary_shard": "node"}),
          ("qwZ + qgZ + hpZ", {"weight_quantization": "int8", "gradient_quantization": "int8",
                               "secondary_shard": "node"})]


def zeropp(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> None:
    """Bytes per step (this rank's, exact: commlib.stats) of FULL_SHARD and its ZeRO++
    options on the WideMLP, one Adam step after warm-up; the hpZ node copy's memory."""
    rank, n = commlib.get_rank(), commlib.get_world_size()
    rows = []
    for name, kw in ZEROPP:
        torch.manual_seed(0)
        m = commlib.FullyShardedDataParallel(build_model(args),
                                             "FULL_SHARD", chunk_size_mb=args.chunk_mb, **kw)
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
        for _ in range(args.warmup):
            step()
        commlib.stats(reset=True)
        step()
        st = commlib.stats(reset=True)
        rows.append((name, {op: v["bytes"] for op, v in st.items()},
                     sum(v["bus_bytes"] for v in st.values()), m.memory_bytes()["secondary"]))
        m.close()
    if rank != 0:
        return
    base = rows[0][2]
    print(f"\nZeRO++ on WideMLP width={args.width} depth={args.depth}, {n} ranks, nodes of "
          f"{commlib.options.local_size or 'host'}, chunks {args.chunk_mb} MiB, fp32\n")
    print("| config | allgather B | reduce_scatter B | alltoall B | bus B/step | vs FULL_SHARD"
          " | hpZ copy |")
    print("|---|---|---|---|---|---|---|")
    for name, b, bus, sec in rows:
        print(f"| {name} | {b.get('allgather', 0):,} | {b.get('reduce_scatter', 0):,} | "
              f"{b.get('alltoall', 0):,} | {bus:,} | {bus / base:.3f}x | {sec:,} B |")


if __name__ == "__main__":
    main()
