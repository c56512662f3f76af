"""ZeRO++ (qwZ, hpZ, qgZ) against FULL_SHARD on an emulated two-tier cluster (issue 24,
part 2): inter-node bytes per step, step time, and the GPT workload's validation loss after
the same number of steps.

    flock /tmp/commlib-bench.lock python benchmarks/bench_zero_pp_cluster.py \\
        --shape 2x2 --rate 1000 --steps 60 [--json benchmarks/results/zero_pp_cluster.json]

The cluster is ``netsim.two_tier`` (root: network namespaces on a bridge, each node's link
shaped by HTB at ``--rate`` Mbit/s each way; ranks of a node share memory). One ``mpiexec``
job trains one ``commlib.FullyShardedDataParallel(FULL_SHARD)`` GPT (benchmarks/gpt.py,
``--d-model/--layers/--heads/--context``, Adam) per configuration, all from the same
initial weights on the same batches (per rank and step), configurations interleaved step by
step:

==================  ==================================================================
FULL_SHARD          fp32 all-gathers and reduce-scatters over the 4 ranks
qwZ                 ``weight_quantization="int8"`` (gathers of int8 blocks)
hpZ                 ``secondary_shard="node"`` (backward gathers inside the node)
qgZ                 ``gradient_quantization="int8", gradient_hierarchy="node"``
                    (reduced inside the node in fp32, int8 node sums across nodes)
qwZ + hpZ + qgZ     all three (ZeRO++)
==================  ==================================================================

Per step: the inter-node bytes are the kernel's exact counters of the nodes' ``eth0``
(``/proc/net/dev`` in each node's namespace: every byte that left a node, TCP/IP headers
included), read between two barriers around the step and summed over the nodes (divided
by the ranks: bytes a rank); commlib's own ``bus_bytes`` (this rank's, all tiers) next to
them. Step time: from the first barrier to the end of ``optimizer.step`` on the slowest
rank; the median over the steps after ``--warmup``. At the end the validation loss
(``gpt.val_loss``, nats a byte) of each configuration, every rank's replica checked equal
to rank 0's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402

# (key for --configs, name, FullyShardedDataParallel options)
CONFIGS: list[tuple[str, str, dict[str, Any]]] = [
    ("full", "FULL_SHARD", {}),
    ("qwz", "qwZ", {"weight_quantization": "int8"}),
    ("hpz", "hpZ", {"secondary_shard": "node"}),
    ("qgz", "qgZ", {"gradient_quantization": "int8", "gradient_hierarchy": "node"}),
    ("zeropp", "qwZ + hpZ + qgZ", {"weight_quantization": "int8", "secondary_shard": "node",
                                   "gradient_quantization": "int8",
                                   "gradient_hierarchy": "node"}),
]


def eth0_tx() -> int:
    """Bytes sent on this network namespace's ``eth0`` so far (0 when there is none)."""
    with open("/proc/net/dev") as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                return int(rest.split()[8])
    return 0


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    import commlib  # before mpi4py.MPI (it prepares MPI's environment)
    # isort: split
    from mpi4py import MPI

    import gpt
    from commlib.mpi.mpi_env import _node
    # --wait auto: the library's rule (the emulated nodes are one machine: it polls when
    # the job's ranks outnumber its cores); spin/poll force the job-wide option, which
    # every blocking call and the sharded wrappers' threads follow
    forced = {"spin": 0, "poll": 50}.get(args.wait)
    commlib.init() if forced is None else commlib.init(wait_poll_us=forced)
    torch.set_num_threads(1)
    rank, n = commlib.get_rank(), commlib.get_world_size()
    local_rank, local_size = _node(MPI.COMM_WORLD)
    cfg = gpt.Config(d_model=args.d_model, layers=args.layers, heads=args.heads,
                     context=args.context)
    data = gpt.corpus(max_bytes=args.max_bytes)
    keys = args.configs.split(",")
    runs = []
    for key, name, kw in CONFIGS:
        if key not in keys:
            continue
        model = commlib.FullyShardedDataParallel(gpt.build(cfg, seed=0), "FULL_SHARD",
                                                 chunk_size_mb=args.chunk_mb, **kw)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        runs.append({"name": name, "model": model, "opt": opt, "times": [], "tx": [],
                     "bus": []})
    psi = sum(p.numel() for p in gpt.build(cfg, seed=0).parameters())
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.warmup + args.steps):
        x, y = gpt.batch(data["train"], args.batch, cfg.context, gen)
        for r in runs:
            commlib.barrier()
            tx0 = eth0_tx() if local_rank == 0 else 0
            before = commlib.stats()
            t0 = time.perf_counter()
            r["opt"].zero_grad()
            gpt.loss(r["model"], x, y).backward()
            r["opt"].step()
            seconds = time.perf_counter() - t0
            after = commlib.stats()
            commlib.barrier()
            tx = (eth0_tx() - tx0) if local_rank == 0 else 0
            got = np.array([seconds, float(tx)])
            slow = commlib.allreduce(got[:1].copy(), op="max")
            total = commlib.allreduce(got[1:].copy(), op="sum")
            if step >= args.warmup:
                r["times"].append(float(slow[0]))
                r["tx"].append(float(total[0]) / n)
                r["bus"].append(sum(v["bus_bytes"] - before.get(op, {}).get("bus_bytes", 0)
                                    for op, v in after.items()))
    from commlib.core import communicator
    out: dict[str, Any] = {"local_size": local_size, "psi": psi, "configs": {},
                           "wait_poll_s": communicator.WAIT_POLL_S}
    for r in runs:
        loss = gpt.val_loss(r["model"], data["val"], cfg.context, windows=args.val_windows)
        state = r["model"].state_dict()
        flat = torch.cat([v.reshape(-1).double() for v in state.values()])
        ref = flat.clone()
        commlib.broadcast(ref, 0)
        same = commlib.allreduce(np.array([float(torch.equal(flat, ref))]), op="min")
        bus = commlib.allreduce(np.array([statistics.median(r["bus"])], dtype=np.float64),
                                op="max")
        out["configs"][r["name"]] = {
            "step_s_median": statistics.median(r["times"]), "step_s": r["times"],
            "inter_node_bytes_per_rank": statistics.median(r["tx"]),
            "bus_bytes_max_rank": float(bus[0]), "val_loss": loss,
            "replicas_equal": bool(same[0])}
        r["model"].close()
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump(out, fh)


def drive(args: argparse.Namespace) -> dict[str, Any]:
    from netsim import two_tier
    nodes, per_node = (int(v) for v in args.shape.split("x"))
    result: dict[str, Any] = {"environment": C.environment(nodes * per_node),
                              "args": vars(args), "load_average": os.getloadavg()}
    with two_tier(nodes, per_node, args.rate or None, args.delay) as cluster:
        result.update(shaped=cluster.shaped, emulation=cluster.why)
        print(f"cluster: {cluster.why}", flush=True)
        if nodes > 1 and cluster.shaped:
            result["measured"] = cluster.measure_bandwidth(0, 1)
            print(f"measured {result['measured']['mbit']:.0f} Mbit/s, rtt "
                  f"{result['measured']['rtt_ms']:.3f} ms", flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
            path = fh.name
        argv = [sys.executable, os.path.abspath(__file__), "--worker", "--out", path,
                *passthrough(args)]
        code = cluster.mpiexec(argv, timeout=args.timeout,
                               env={"COMMLIB_TIMEOUT": str(args.timeout)})
        if code:
            raise SystemExit(f"worker exited {code}")
        with open(path) as fh:
            result.update(json.load(fh))
        os.unlink(path)
    result["load_average_after"] = os.getloadavg()
    return result


def passthrough(args: argparse.Namespace) -> list[str]:
    keys = ("d_model", "layers", "heads", "context", "batch", "steps", "warmup", "lr",
            "chunk_mb", "max_bytes", "val_windows", "configs", "wait")
    return [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


def report(result: dict[str, Any]) -> str:
    base = result["configs"]["FULL_SHARD"]
    a = result["args"]
    lines = [f"GPT d_model {a['d_model']}, {a['layers']} layers, context {a['context']}, "
             f"psi = {result['psi']:,}, batch {a['batch']}/rank, Adam lr {a['lr']}, "
             f"{a['steps']} steps after {a['warmup']}; {a['shape']} at {a['rate']:g} Mbit/s "
             f"({result.get('emulation', '')}); load average "
             f"{', '.join(f'{v:.1f}' for v in result['load_average'])}; blocking waits "
             f"{'poll every %g us' % (result['wait_poll_s'] * 1e6) if result.get('wait_poll_s') else 'block in MPI'}",
             "",
             "| config | inter-node B/step/rank | vs FULL_SHARD | commlib bus B/step | "
             "step ms (median) | vs FULL_SHARD | val loss | vs FULL_SHARD | replicas equal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, c in result["configs"].items():
        lines.append(
            f"| {name} | {c['inter_node_bytes_per_rank']:,.0f} | "
            f"{c['inter_node_bytes_per_rank'] / base['inter_node_bytes_per_rank']:.3f}x | "
            f"{c['bus_bytes_max_rank']:,.0f} | {c['step_s_median'] * 1e3:.1f} | "
            f"{c['step_s_median'] / base['step_s_median']:.2f}x | {c['val_loss']:.4f} | "
            f"{(c['val_loss'] / base['val_loss'] - 1) * 100:+.2f}% | {c['replicas_equal']} |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="2x2", help="NODESxRANKS_PER_NODE")
    ap.add_argument("--rate", type=float, default=1000.0, help="Mbit/s per node link")
    ap.add_argument("--delay", type=float, default=0.0, help="ms (needs netem)")
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2, help="windows per rank and step")
    ap.add_argument("--steps", type=int, default=60, help="timed steps (after warm-up)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--chunk-mb", type=float, default=4.0)
    ap.add_argument("--max-bytes", type=int, default=4 << 20)
    ap.add_argument("--val-windows", type=int, default=64)
    ap.add_argument("--configs", default=",".join(key for key, _, _ in CONFIGS),
                    help="keys among " + ", ".join(f"{k} ({n})" for k, n, _ in CONFIGS))
    ap.add_argument("--wait", choices=("auto", "spin", "poll"), default="auto",
                    help="how the wrappers' threads wait for MPI (auto: poll when the job's "
                         "ranks outnumber this host's cores)")
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    result = drive(args)
    print("\n" + report(result))
    if args.json:
        C.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
