"""``mpiexec -n 4 python -m commlib.tools.selftest``: run every collective, check it against a
numpy reference, and report pass/fail and bandwidth on rank 0. Exits non-zero on any
failure (on every rank), so it can gate an installation."""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import primitives as P
from ..base.reduce_ops import ReduceOp
from ..core import runtime


def _data(rank: int, numel: int) -> np.ndarray:
    return (np.arange(numel) % 17 + rank).astype(np.float32)


def _cases(n: int, numel: int) -> dict[str, tuple[Callable[[int], Any], Callable[[], Any]]]:
    """name -> (run on this rank's input, expected result on this rank), and bus factor."""
    full = [_data(r, numel) for r in range(n)]
    total = np.sum(full, axis=0)
    rank = runtime.get_rank()
    per = numel // n

    def a2a_expected() -> np.ndarray:
        return np.concatenate([full[s][rank * per:(rank + 1) * per] for s in range(n)])

    return {
        "allreduce": (lambda x: P.allreduce(x), lambda: total),
        "allreduce_avg": (lambda x: P.allreduce(x, op=ReduceOp.AVG), lambda: total / n),
        "allreduce_async": (lambda x: P.allreduce(x, async_op=True).wait(), lambda: total),
        "reduce": (lambda x: P.reduce(x, dst=n - 1),
                   lambda: total if rank == n - 1 else full[rank]),
        "broadcast": (lambda x: P.broadcast(x, src=n - 1), lambda: full[n - 1]),
        "allgather": (lambda x: P.allgather(x), lambda: np.stack(full)),
        "reduce_scatter": (lambda x: P.reduce_scatter(x),
                           lambda: np.array_split(total, n)[rank]),
        "alltoall": (lambda x: P.alltoall(x[:per * n]), a2a_expected),
        "sendrecv_ring": (lambda x: _ring(x, rank, n), lambda: full[(rank - 1) % n]),
        "barrier": (lambda x: P.barrier(), lambda: None),
    }


def _ring(x: np.ndarray, rank: int, n: int) -> np.ndarray:
    out = np.empty_like(x)
    work = P.send(x, (rank + 1) % n, tag=1, async_op=True)
    P.recv(out, (rank - 1) % n, tag=1)
    work.wait()
    return out


BUS = {"allreduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
       "allgather": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n}


def _check(name: str, run: Callable, expected: Callable, numel: int) -> bool:
    rank = runtime.get_rank()
    got = run(_data(rank, numel))
    want = expected()
    if want is None:
        return True
    return bool(np.allclose(np.asarray(got), want, rtol=1e-5))


def _bandwidth(name: str, run: Callable, numel: int, reps: int) -> float:
    x = _data(runtime.get_rank(), numel)
    P.barrier()
    times = []
    for _ in range(reps):
        buf = x.copy()
        start = time.perf_counter()
        run(buf)
        times.append(time.perf_counter() - start)
    n = runtime.get_world_size()
    base = name.split("_")[0] if name.startswith("allreduce") else name
    factor = BUS.get(base, lambda n: 1.0)(n)
    return x.nbytes * factor / float(np.median(times)) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commlib-selftest", description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=4.0, help="bandwidth buffer size (MiB)")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per collective")
    args = parser.parse_args(argv)
    world = runtime.world()
    n, rank = world.size, world.rank
    small, big = 1031, max(int(args.size_mb * (1 << 20)) // 4, n)
    rows, failed = [], 0
    for name, (run, expected) in _cases(n, small).items():
        ok = all(P.allgather(np.array([_check(name, run, expected, small)]))[:, 0])
        bigrun = _cases(n, big)[name][0]
        bw = _bandwidth(name, bigrun, big, args.reps)
        failed += not ok
        rows.append((name, "PASS" if ok else "FAIL", bw))
    if rank == 0:
        print(f"commlib self-test on {n} ranks; bandwidth with {args.size_mb:g} MiB float32, "
              f"median of {args.reps} (busbw, nccl-tests factors)")
        for name, status, bw in rows:
            shown = "-" if name == "barrier" else f"{bw:8.3f} GB/s"
            print(f"  {name:<16} {status}   {shown}")
        print("self-test " + ("PASSED" if not failed else f"FAILED ({failed} collectives)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
