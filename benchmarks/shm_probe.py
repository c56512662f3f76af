"""Does the node window's cross-core probe predict the shared-memory tier's speed? (issue 33)

    for i in 1 2 3 4 5 6 7 8; do
        mpiexec -n 2 python benchmarks/shm_probe.py --json benchmarks/results/shm_probe_modes.json
    done

One job: the world's node window is made (which runs
:func:`commlib.primitives.shm_window.cross_core_ratio`: how much slower a rank reads what
its neighbour just wrote than what it wrote itself), then 20 blocking 64 MiB float32
allreduces go through the tier (``COMMLIB_SHM=1``) and 20 through MPI (``COMMLIB_SHM=0``),
each after a barrier; medians of the last 16, the slowest rank. Each job appends one
record (ratio, ``far``, both medians) to ``--json``: on a machine whose ranks sometimes
share a last-level cache and sometimes do not (a VM whose vCPUs the host moves), the jobs
fall into two groups, and the ratio says which.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="append this job's record (a JSON list)")
    p.add_argument("--mib", type=int, default=64)
    args = p.parse_args()
    import commlib
    from commlib.base.options import options
    from commlib.primitives import node_shm
    nw = node_shm.window(commlib.world().comm)
    if nw is None:
        raise SystemExit("needs at least 2 ranks on one node")
    x = np.ones((args.mib << 20) // 4, np.float32)
    medians = {}
    for setting in ("1", "0"):
        options.shm = setting
        ts = []
        for _ in range(20):
            commlib.barrier()
            t0 = time.perf_counter()
            commlib.allreduce(x)
            ts.append(time.perf_counter() - t0)
        medians[setting] = float(commlib.allreduce(np.array([np.median(ts[4:])]),
                                                   op="max")[0])
    if commlib.get_rank() != 0:
        return
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "ranks": commlib.get_world_size(),
              "cross_core_ratio": nw.cross_ratio, "far": nw.far, "mib": args.mib,
              "tier_ms": 1e3 * medians["1"], "mpi_ms": 1e3 * medians["0"],
              "load": os.getloadavg()[0]}
    print(f"ratio {nw.cross_ratio:.2f} far {nw.far}: {args.mib} MiB allreduce, tier "
          f"{record['tier_ms']:.1f} ms, MPI {record['mpi_ms']:.1f} ms", flush=True)
    if args.json:
        runs = json.load(open(args.json))["runs"] if os.path.exists(args.json) else []
        C.write_json(args.json, {"environment": C.environment(commlib.get_world_size()),
                                 "runs": runs + [record]})


if __name__ == "__main__":
    main()
