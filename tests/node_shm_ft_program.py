"""A rank killed in the middle of a shared-memory collective, in fault-tolerant mode;
driven by test_node_shm.py.

Usage: python node_shm_ft_program.py OUTDIR OP [--no-ft]

Every rank runs blocking OP (allreduce, reduce_scatter, allgather or broadcast) on 2 MiB of
float32 through the shared-memory tier (``COMMLIB_SHM=1``: two steps of 1 MiB per call),
checking each result exactly. At iteration 5 the last rank SIGKILLs itself inside the
collective: after it copied its first step's data into the window, at its first barrier,
so the survivors are past their own copy and wait in that barrier (or read its segment).
Where the launch makes each rank a node of its own (MPICH's one hydra proxy per rank, which
fault-tolerant jobs need there), the collectives take the MPI path and the victim dies
before its call at iteration 5 instead.
Each survivor must get :class:`commlib.PeerFailure`, shrink the world, and finish the
remaining iterations on the survivors' group (a new window) with exact results. Every rank
writes ``OUTDIR/shm{r}.json`` (the shared-memory files it maps) after ``init`` and again
after its first collective (the window's file among them); each
survivor writes ``OUTDIR/rank{r}.json`` (iterations, seconds from the kill's iteration to
its PeerFailure, shared-memory calls made). ``--no-ft``: fault tolerance off (the control:
the job must end, by the launcher or the watchdog, never hang).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

OUTDIR, OP = sys.argv[1], sys.argv[2]
FT = "--no-ft" not in sys.argv
os.environ["COMMLIB_FAULT_TOLERANT"] = "1" if FT else "0"
os.environ["COMMLIB_SHM"] = "1"

import commlib  # noqa: E402
from commlib import PeerFailure  # noqa: E402
from commlib.primitives import node_shm  # noqa: E402
from elastic_common import write_shm  # noqa: E402

ITERS = 12
KILL_AT = 5
COUNT = (2 << 20) // 4

commlib.init(fault_tolerant=FT)
me = commlib.get_rank()
n0 = commlib.get_world_size()
write_shm(OUTDIR, me)
victim = me == n0 - 1


def one(group, it: int) -> None:
    n, r = group.size, group.rank
    if OP == "allreduce":
        x = np.full(COUNT, float(it * 10 + r + 1), np.float32)
        group.allreduce(x)
        ok = np.all(x == sum(it * 10 + k + 1 for k in range(n)))
    elif OP == "reduce_scatter":
        x = np.arange(COUNT, dtype=np.float32) % 1000 + it + r
        y = commlib.reduce_scatter(x, group=group)
        lo = sum(commlib.block_sizes(COUNT, n)[:r])
        full = n * (np.arange(COUNT, dtype=np.float32) % 1000 + it) + sum(range(n))
        ok = np.array_equal(y, full[lo:lo + y.size])
    elif OP == "allgather":
        y = commlib.allgather(np.full(COUNT, float(it * 10 + r), np.float32), group=group)
        ok = all(np.all(y[k] == it * 10 + k) for k in range(n))
    else:
        root = it % n
        x = np.full(COUNT, float(it + 0.5 if r == root else -1), np.float32)
        group.broadcast(x, src=root)
        ok = np.all(x == it + 0.5)
    if not ok:
        raise AssertionError(f"rank {me} iteration {it}: wrong {OP} result on {n} ranks")


if victim:
    real_sync = node_shm.NodeWindow.sync

    def dying_sync(self):  # the victim's first barrier of iteration KILL_AT
        if dying_sync.armed:
            os.kill(os.getpid(), signal.SIGKILL)
        real_sync(self)

    dying_sync.armed = False
    node_shm.NodeWindow.sync = dying_sync

group = commlib.world()
it, failed_after, failures = 0, None, 0
while it < ITERS:
    if victim and it == KILL_AT:
        if not node_shm.COUNTS[OP]:  # the launch put each rank on a node of its own
            os.kill(os.getpid(), signal.SIGKILL)
        dying_sync.armed = True
    started = time.monotonic()
    try:
        one(group, it)
        if it == 0:  # again, with the window's file (if it still had a name)
            write_shm(OUTDIR, me)
        it += 1
    except PeerFailure:
        failures += 1
        failed_after = time.monotonic() - started
        group = group.shrink(value=it)
        it = group.agreement.min
with open(os.path.join(OUTDIR, f"rank{me}.json"), "w") as f:
    json.dump({"rank": me, "iters": it, "failures": failures, "size": group.size,
               "failed_after_s": failed_after, "shm_calls": dict(node_shm.COUNTS)}, f)
print(f"rank {me}: finished", flush=True)
