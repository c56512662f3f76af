"""Fault-tolerant groups under a real failure; driven by test_elastic_ft.py.

Usage: python elastic_ft_program.py OUTDIR CASE [--iters N] [--size BYTES] [--no-ft]

Every rank runs allreduces (and, every third iteration, a broadcast) on the world in
fault-tolerant mode, checking each result against the exact expected value; on
:class:`commlib.PeerFailure` it shrinks the world with its iteration count as the value,
checks the agreement, and goes on from the agreed iteration. CASE (the victims are the
last ranks):

``kill``         the last rank SIGKILLs itself at iteration 20
``exit``         the last rank leaves with ``os._exit(5)`` at iteration 20
``two``          the last rank is killed at iteration 20, the one before at iteration 40
``during``       the last rank is killed at iteration 20; the one before dies inside the
                 survivors' agreement (right after sending its first message)
``creating``     the last rank is killed at iteration 20; the one before dies while the
                 survivors build their communicator (after the agreement)
``sysexit``      the last rank calls ``sys.exit(0)`` at iteration 20 (an ordinary exit)
``stuck``        the last rank is killed at iteration 20; every survivor's first attempt
                 at their communicator never returns (as once on Open MPI under load):
                 they give it up after ``create_limit()`` and build it again; then they
                 duplicate it, and under ULFM (built by name, not by MPI's allocator)
                 survivor 0's first attempt at the duplicate never returns (the others'
                 wait in MPI for it): all give it up and build it again
``stuck_window`` (ULFM, run with ``COMMLIB_SHM=1`` and ``COMMLIB_TIMEOUT=12``) the last
                 rank is killed at iteration 20; the survivors' first allreduce makes the
                 shared-memory window, whose communicators (built by name after a failure)
                 are created under that allreduce's deadline: the first attempts at the
                 first two of them never return, on every survivor, and are given up
                 after ``create_limit()`` (10 s) each, longer in all than the deadline;
                 the creations postpone it (:func:`commlib.mpi.watchdog.postpone`), so the
                 third attempt builds the node and the job finishes. ``--no-postpone``
                 (the negative control): the deadline is not moved, the watchdog aborts

Every rank writes ``OUTDIR/shm{r}.json`` (the shared-memory segments it maps) after ``init``; each
rank that finishes writes ``OUTDIR/rank{r}.json``: its iterations, the groups it went
through (sizes, agreed values, seconds from the failure's detection to the first correct
collective after it), and its exception count. Victims write nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

parser = argparse.ArgumentParser()
parser.add_argument("outdir")
parser.add_argument("case")
parser.add_argument("--iters", type=int, default=60)
parser.add_argument("--size", type=int, default=8192)
parser.add_argument("--no-ft", action="store_true", help="fault tolerance off (control)")
parser.add_argument("--victim-rank", type=int, default=None, help="the (first) victim")
parser.add_argument("--no-postpone", action="store_true",
                    help="stuck_window: creations do not postpone the deadline (control)")
args = parser.parse_args()
# fault-tolerant mode from the environment, known before MPI starts (commlib.mpi.ucx_env)
os.environ["COMMLIB_FAULT_TOLERANT"] = "0" if args.no_ft else "1"

import commlib  # noqa: E402
from commlib import PeerFailure  # noqa: E402
from commlib.fault import agreement as agreement_module  # noqa: E402
from elastic_common import write_shm  # noqa: E402

if os.environ.get("ELASTIC_DUMP"):  # debugging: every rank's stacks after that long
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ["ELASTIC_DUMP"]), exit=True)
commlib.init(fault_tolerant=not args.no_ft)
world_rank = commlib.get_rank()
write_shm(args.outdir, world_rank)
n0 = commlib.get_world_size()
count = max(1, args.size // 8)


def die(how: str) -> None:
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "exit":
        os._exit(5)
    elif how == "sysexit":
        sys.exit(0)


def victim_plan() -> dict[int, tuple[int, str]]:
    last = n0 - 1 if args.victim_rank is None else args.victim_rank
    before = n0 - 2
    plan = {"kill": {last: (20, "kill")}, "exit": {last: (20, "exit")},
            "sysexit": {last: (20, "sysexit")},
            "two": {last: (20, "kill"), before: (40, "kill")},
            "during": {last: (20, "kill"), before: (-1, "agreement")},
            "creating": {last: (20, "kill"), before: (-1, "creating")},
            "stuck": {last: (20, "kill")}, "stuck_window": {last: (20, "kill")}}[args.case]
    return plan


plan = victim_plan().get(world_rank)
if plan is not None and plan[1] == "agreement":
    original = agreement_module.Agreement.decide

    def dying_decide(self, universe, value, dead, timeout):  # sends its message, then dies
        ctl = self.ctl
        message = (tuple(universe), frozenset(dead()) & frozenset(universe), 0, value)
        for q in universe:
            if q != self.me and q not in message[1]:
                ctl.send(message, dest=q, tag=agreement_module.AGREE_TAG)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

    agreement_module.Agreement.decide = dying_decide
if plan is not None and plan[1] == "creating":
    from commlib.fault import fault_tolerance
    original_in_thread = fault_tolerance.in_thread

    def dying_in_thread(comm, op, fn, *a, **kw):
        if op in ("Comm_create_group", "Comm_create_from_group"):  # (ULFM: ft_backend)
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        return original_in_thread(comm, op, fn, *a, **kw)

    fault_tolerance.in_thread = dying_in_thread
if args.case == "stuck" and plan is None:
    import threading

    from commlib.fault import ft_backend
    creations = []
    real_create = ft_backend.backend().create

    def stuck_create(*a):  # the first attempt never returns; later ones are MPI's
        creations.append(a[-1])
        if len(creations) == 1:
            threading.Event().wait()
        if world_rank == 0 and "/dup#" in a[-1] and "~" not in a[-1]:
            threading.Event().wait()  # (ULFM) survivor 0's first attempt at the Dup
        return real_create(*a)

    ft_backend.backend().create = stuck_create

if args.case == "stuck_window" and plan is None:
    import threading

    from commlib.fault import fault_tolerance as _ft
    from commlib.fault import ft_backend
    creations = []
    real_create = ft_backend.backend().create

    def stuck_first_attempts(*a):  # the first attempt at the first two derived creations
        name = a[-1]  # (f"{key}/{what}#{n}", later attempts f"...~{attempt}")
        if "#" in name:
            creations.append(name)
            if "~" not in name and len([c for c in creations if "~" not in c]) <= 2:
                threading.Event().wait()
        return real_create(*a)

    ft_backend.backend().create = stuck_first_attempts
    if args.no_postpone:
        _ft.postpone = lambda seconds: None

group = commlib.world()
it = 0
groups = [{"size": group.size, "ranks": list(group.ranks)}]
failures = 0
detected_at = None
while it < args.iters:
    if plan is not None and plan[0] == it:
        die(plan[1])
    try:
        x = np.full(count, float(it * 100 + group.rank + 1))
        group.allreduce(x)
        expected = sum(it * 100 + r + 1 for r in range(group.size))
        if not np.all(x == expected):
            raise AssertionError(f"rank {world_rank} iteration {it}: allreduce gave "
                                 f"{x[:3]} instead of {expected} on {group.size} ranks")
        if it % 3 == 0:
            y = np.full(count, float(group.rank))
            root = it % group.size
            if group.rank == root:
                y[:] = it + 0.5
            group.broadcast(y, src=root)
            if not np.all(y == it + 0.5):
                raise AssertionError(f"rank {world_rank} iteration {it}: broadcast gave "
                                     f"{y[:3]}")
        if detected_at is not None:
            groups[-1]["recovery_s"] = time.monotonic() - detected_at
            detected_at = None
        it += 1
    except PeerFailure as exc:
        failures += 1
        detected_at = time.monotonic()
        group = group.shrink(value=it)
        d = group.agreement
        if not (d.max - d.min <= 1):
            raise AssertionError(f"rank {world_rank}: survivors more than one iteration apart: "
                                 f"{d.values}")
        groups.append({"size": group.size, "ranks": list(group.ranks), "failed": exc.failed,
                       "values": {str(k): v for k, v in d.values.items()}, "min": d.min,
                       "max": d.max})
        it = d.min  # redo the iteration some did not finish (idempotent here)
        if args.case == "stuck":
            start = time.monotonic()
            dup = group.comm.dup("stuck-dup").mpi
            z = np.full(4, float(group.rank + 1))
            dup.Allreduce(MPI.IN_PLACE, z)
            if not np.all(z == sum(range(1, group.size + 1))):
                raise AssertionError(f"rank {world_rank}: the duplicate's allreduce gave {z}")
            groups[-1]["dup_s"] = time.monotonic() - start
            # and a split of it that leaves survivor 0 out (under ULFM by name too: the
            # rank in no group takes part in the members' agreement only)
            sub = group.comm.split(group.rank != 0, group.rank, "stuck-split")
            if (sub is None) != (group.rank == 0):
                raise AssertionError(f"rank {world_rank}: split gave {sub}")
            if sub is not None:
                z = np.full(4, float(sub.rank + 1))
                sub.mpi.Allreduce(MPI.IN_PLACE, z)
                if sub.size != group.size - 1 or not np.all(z == sum(range(1, sub.size + 1))):
                    raise AssertionError(f"rank {world_rank}: the split's allreduce gave {z}")
            groups[-1]["split"] = sub is not None
        if commlib.get_world_size() != group.size or commlib.get_rank() != group.rank:
            raise AssertionError("the world did not shrink with the group")

with open(os.path.join(args.outdir, f"rank{world_rank}.json"), "w") as f:
    from commlib.fault import fault_tolerance as ft_module
    watcher = ft_module.watcher()
    json.dump({"rank": world_rank, "iters": it, "groups": groups, "failures": failures,
               "polls": watcher.polls, "launcher_reads": watcher.launcher_reads,
               "creations": len(creations) if args.case.startswith("stuck") else None,
               "waits": dict(ft_module.COUNTS)}, f)
