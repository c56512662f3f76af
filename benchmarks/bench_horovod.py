"""commlib.horovod against real Horovod 0.28.1, commlib's DDP and torch DDP over gloo.

Two measurements, both at 2 and 4 ranks by default:

* **training throughput** in the shape of Horovod's ``pytorch_synthetic_benchmark.py``: a
  small torchvision-style CNN (conv-BN-ReLU-pool, conv-BN-ReLU, global pool, 1000-way
  linear) on fixed synthetic 3x224x224 images, SGD, CPU, one torch thread per rank; img/s
  over all ranks. ``commlib.horovod`` (``hvd.DistributedOptimizer``), commlib's
  ``DistributedDataParallel`` and torch DDP over gloo run interleaved (rep after rep) in one
  mpiexec job; real Horovod runs in its own job (its own venv, ``--horovod-python``), the
  jobs alternating, so machine noise hits all alike;
* **small-allreduce latency**: a blocking 8-float ``hvd.allreduce`` against
  ``commlib.allreduce`` interleaved call by call in the same job (and real Horovod's
  ``hvd.allreduce`` in its job); median of many calls, rank 0's clock.

    python benchmarks/bench_horovod.py --ranks 2 4 --reps 3 \\
        --horovod-python /work/hvdvenv/bin/python      # real Horovod's venv, optional
    python benchmarks/bench_horovod.py --old-tree /tmp/old   # also an older commlib checkout
    python benchmarks/bench_horovod.py --latency --ranks 2 4 --reps 3   # latency only
    python benchmarks/bench_horovod.py --rate 1000 --algorithm bytegrad --no-ddp \
        --ranks 2 4 --horovod-python /work/hvdvenv/bin/python   # emulated 1 Gbit/s links

Figures are medians over repetitions; every job is launched by this driver (no mpiexec
around it).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# -- the workers (run under mpiexec) ---------------------------------------------------
def small_cnn(width: int):
    import torch.nn as nn
    return nn.Sequential(
        nn.Conv2d(3, width, 7, stride=4, padding=3, bias=False), nn.BatchNorm2d(width),
        nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width),
        nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(2 * width, 1000))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(1)
    if args.worker == "horovod":
        import horovod.torch as hvd
    else:
        import commlib.horovod as hvd
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    data = torch.randn(args.batch_size, 3, 224, 224)
    target = torch.randint(0, 1000, (args.batch_size,))

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.01 * n)

    def step_of(model, opt):
        def step():
            opt.zero_grad()
            F.cross_entropy(model(data), target).backward()
            opt.step()
        return step

    steps = {}
    m = small_cnn(args.width)
    opt = hvd.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters())
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    steps["horovod" if args.worker == "horovod" else "commlib.horovod"] = step_of(m, opt)
    for alg in (args.algorithm if args.worker == "commlib" else []):
        ma = small_cnn(args.width)
        opta = hvd.DistributedOptimizer(sgd(ma), named_parameters=ma.named_parameters(),
                                        algorithm=alg)
        hvd.broadcast_parameters(ma.state_dict(), root_rank=0)
        steps[f"commlib.horovod algorithm={alg}"] = step_of(ma, opta)
    if args.worker == "commlib" and not args.no_ddp:
        import commlib
        ddp = commlib.DistributedDataParallel(small_cnn(args.width))
        steps["commlib DDP"] = step_of(ddp, sgd(ddp))
        import socket

        import numpy as np
        import torch.distributed as dist
        port = np.array([0])
        if rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port[0] = s.getsockname()[1]
        commlib.broadcast(port, src=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port[0])}",
                                rank=rank, world_size=n)
        tddp = torch.nn.parallel.DistributedDataParallel(small_cnn(args.width))
        steps["torch DDP gloo"] = step_of(tddp, sgd(tddp))
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    times = {k: [] for k in steps}
    for _ in range(args.iters):
        for name, step in steps.items():
            hvd.allreduce(torch.zeros(1), name="sync")   # start together
            t0 = time.perf_counter()
            for _ in range(args.batches_per_iter):
                step()
            dt = float(hvd.allreduce(torch.tensor([time.perf_counter() - t0]), op=hvd.Max,
                                     name="dt"))
            times[name].append(dt)
    # latency of a small blocking allreduce, interleaved with commlib.allreduce
    t = torch.ones(8)
    mine = "Horovod 0.28.1 hvd.allreduce" if args.worker == "horovod" else "hvd.allreduce"
    lat = {mine: []}
    if args.worker == "commlib":
        import commlib
        lat["commlib.allreduce"] = []
    for _ in range(50):
        hvd.allreduce(t, op=hvd.Sum)
    for _ in range(args.latency_reps):
        t0 = time.perf_counter()
        hvd.allreduce(t, op=hvd.Sum)
        lat[mine].append(time.perf_counter() - t0)
        if args.worker == "commlib":
            x = t.clone()
            t0 = time.perf_counter()
            commlib.allreduce(x)
            lat["commlib.allreduce"].append(time.perf_counter() - t0)
    if rank == 0:
        for name, ts in times.items():
            print(f"IMG_S {name}: {n * args.batch_size * args.batches_per_iter / statistics.median(ts):.2f}",
                  flush=True)
        for name, ts in lat.items():
            print(f"LAT_US {name}: {statistics.median(ts) * 1e6:.1f}", flush=True)
    hvd.shutdown()


def latency_worker(args: argparse.Namespace) -> None:
    """``--latency``: a blocking ``hvd.allreduce`` of ``--latency-floats`` float32
    (unnamed and named) against ``commlib.allreduce`` of the same tensor, interleaved call
    by call in this job; every call starts after a barrier-free warm-up. Prints rank 0's
    median wall-clock and thread-CPU microseconds per call."""
    import torch
    torch.set_num_threads(1)
    if args.worker == "horovod":
        import horovod.torch as hvd
    else:
        import commlib
        import commlib.horovod as hvd
    hvd.init()
    t = torch.ones(args.latency_floats)
    calls = {"hvd.allreduce": lambda: hvd.allreduce(t, op=hvd.Sum),
             "hvd.allreduce named": lambda: hvd.allreduce(t, op=hvd.Sum, name="lat")}
    if args.worker == "horovod":
        calls = {"Horovod 0.28.1 " + k: v for k, v in calls.items()}
    else:
        x = t.clone()
        calls["commlib.allreduce"] = lambda: commlib.allreduce(x)
    wall = {k: [] for k in calls}
    cpu = {k: [] for k in calls}
    for _ in range(200):
        for fn in calls.values():
            fn()
    clock, thread = time.perf_counter, time.thread_time
    for _ in range(args.latency_reps):
        for k, fn in calls.items():
            c0, t0 = thread(), clock()
            fn()
            t1, c1 = clock(), thread()
            wall[k].append(t1 - t0)
            cpu[k].append(c1 - c0)
    if hvd.rank() == 0:
        for k in calls:
            print(f"LAT_US {k}: {statistics.median(wall[k]) * 1e6:.1f}", flush=True)
            print(f"CPU_US {k}: {statistics.median(cpu[k]) * 1e6:.1f}", flush=True)
    hvd.shutdown()


def latency_main(args: argparse.Namespace, jobs: list) -> int:
    print(f"# load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for n in args.ranks:
        results: dict = {}
        for rep in range(args.reps):
            for kind, python, tree, tag in jobs[rep % len(jobs):] + jobs[:rep % len(jobs)]:
                for (key, name), v in launch(python, n, kind, args, tree).items():
                    results.setdefault((key, name + tag), []).append(v)
        print(f"\n## {n} ranks: blocking allreduce of {args.latency_floats} float32, median "
              f"of {args.latency_reps} calls per job, median of {args.reps} jobs "
              f"(load average now {os.getloadavg()[0]:.1f})")
        print("| call | wall us | thread CPU us |\n|---|---|---|")
        names = sorted({name for _, name in results})
        for name in names:
            w = statistics.median(results.get(("LAT_US", name), [float("nan")]))
            c = statistics.median(results.get(("CPU_US", name), [float("nan")]))
            print(f"| {name} | {w:.1f} | {c:.1f} |")
    print(f"\n# load average at end: {os.getloadavg()[0]:.1f}")
    return 0


# -- the driver --------------------------------------------------------------------------
def launch(python: str, n: int, kind: str, args: argparse.Namespace, tree: str,
           cluster=None) -> dict:
    mpiexec = os.path.join(os.path.dirname(python), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    # on an emulated cluster (--rate): its mpiexec line (both venvs carry mpich 5.0.2)
    head = cluster.prefix() if cluster is not None else [mpiexec, "-n", str(n)]
    cmd = head + [python, os.path.abspath(__file__), "--worker", kind,
           "--batch-size", str(args.batch_size), "--width", str(args.width),
           "--warmup", str(args.warmup), "--iters", str(args.iters),
           "--batches-per-iter", str(args.batches_per_iter),
           "--latency-reps", str(args.latency_reps),
           "--latency-floats", str(args.latency_floats)] + (["--latency"] if args.latency else []) \
        + [x for alg in args.algorithm for x in ("--algorithm", alg)] \
        + (["--no-ddp"] if args.no_ddp else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_"))}
    if cluster is not None:
        env.update(cluster.env)
    env["PYTHONPATH"] = tree
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    got = {}
    for key, name, value in re.findall(r"^(IMG_S|LAT_US|CPU_US) (.+): ([0-9.]+)$", out.stdout,
                                       re.M):
        got[(key, name)] = float(value)
    return got


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--reps", type=int, default=3, help="jobs per contender and rank count")
    p.add_argument("--horovod-python", help="python of a venv with horovod 0.28.1")
    p.add_argument("--old-tree", help="another commlib checkout to measure (before/after)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--batches-per-iter", type=int, default=3)
    p.add_argument("--latency-reps", type=int, default=2000)
    p.add_argument("--latency", action="store_true",
                   help="only the small-allreduce latency (hvd.allreduce vs commlib.allreduce "
                        "in one job, wall and thread-CPU medians)")
    p.add_argument("--latency-floats", type=int, default=4)
    p.add_argument("--algorithm", action="append", default=[],
                   help="also train commlib.horovod with DistributedOptimizer(algorithm=A) "
                        "(repeatable; e.g. bytegrad)")
    p.add_argument("--rate", type=float, default=None,
                   help="run every job on an emulated two-tier cluster (benchmarks/netsim.py) "
                        "with links of RATE Mbit/s, --ranks-per-node ranks per node")
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--no-ddp", action="store_true",
                   help="leave commlib's DDP and torch DDP out of the commlib jobs")
    p.add_argument("--worker", choices=["commlib", "horovod"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        (latency_worker if args.latency else worker)(args)
        return 0
    jobs = [("commlib", sys.executable, REPO, "")]
    if args.old_tree:
        jobs.append(("commlib", sys.executable, args.old_tree, " (old tree)"))
    if args.horovod_python:
        jobs.append(("horovod", args.horovod_python, "", ""))
    if args.latency:
        return latency_main(args, jobs)
    print(f"# load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for n in args.ranks:
        results: dict = {}
        with contextlib.ExitStack() as stack:
            cluster = None
            if args.rate is not None:
                sys.path.insert(0, HERE)
                import netsim
                if n % args.ranks_per_node:
                    raise SystemExit(f"--ranks {n} is not a multiple of --ranks-per-node")
                cluster = stack.enter_context(netsim.two_tier(
                    nodes=n // args.ranks_per_node, ranks_per_node=args.ranks_per_node,
                    rate_mbit=args.rate))
                print(f"# {n} ranks on an emulated cluster: {cluster.why or 'shaped'}; "
                      f"{cluster.measure_bandwidth() if cluster.shaped else 'not shaped'}")
            for rep in range(args.reps):
                for kind, python, tree, tag in jobs[rep % len(jobs):] + jobs[:rep % len(jobs)]:
                    for (key, name), v in launch(python, n, kind, args, tree, cluster).items():
                        results.setdefault((key, name + tag), []).append(v)
        img = {name: statistics.median(v) for (k, name), v in results.items() if k == "IMG_S"}
        lat = {name: statistics.median(v) for (k, name), v in results.items() if k == "LAT_US"}
        ref = img.get("horovod")
        print(f"\n## {n} ranks: img/s (all ranks), median of {args.reps} jobs")
        print("| contender | img/s | vs Horovod |\n|---|---|---|")
        for name, v in sorted(img.items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {v:.1f} | {v / ref:.2f}x |" if ref else f"| {name} | {v:.1f} | - |")
        print(f"\n## {n} ranks: blocking allreduce of 8 floats, median us")
        print("| call | us |\n|---|---|")
        for name, v in sorted(lat.items()):
            print(f"| {name} | {v:.1f} |")
    print(f"\n# load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
