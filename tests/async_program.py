"""``async_model_average`` under faults; driven by test_async_faults.py under ``mpiexec``.

Usage: python async_program.py MODE [--steps N]

``end``        train, then the script ends without close() (nor average_parameters())
``sys_exit``   train, then ``sys.exit(0)`` without close()
``exception``  train, then an uncaught exception (run with COMMLIB_ABORT_ON_EXCEPTION=0:
               the process ends with status 1 through the normal exit path)
``stuck``      after training, rank 1's averaging thread gets stuck in its snapshot (a peer
               alive but stuck), so the others' averaging threads wait for it in their
               next round; every script ends without close()
``thread_fails``  rank 1's snapshot raises at step 20 (its averaging thread fails)
``step_raises``  ``optimizer.step`` raises on the last rank at step 10 (a closure that
               raises); the program catches it and trains on
``average``    ``average_parameters()`` at several points while rounds are in flight; every
               rank reports whether the replicas were bitwise identical right after it and
               after the next forward; ``--control`` averages without the algorithm's
               cooperation (the replica check must then report a difference)

Prints ``RESULT {json}`` on every rank that gets to the end. The wrapper is kept alive
until the interpreter exits (as in a script that builds it at module level), so a script
that ends without close() leaves its threads to commlib's exit handler.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F

import commlib

KEEP = []  # alive until the interpreter exits


def make_ddp(interval_ms: float):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 10))
    return commlib.DistributedDataParallel(model, algorithm="async_model_average",
                                           sync_interval_ms=interval_ms)


def step(ddp, opt, rank: int, i: int, closure=None) -> None:
    g = torch.Generator().manual_seed(1000 * i + rank)
    x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
    opt.zero_grad()
    F.cross_entropy(ddp(x), y).backward()
    opt.step(closure) if closure is not None else opt.step()


def identical(ddp) -> bool:
    """Collective (world, main thread): are every rank's parameters bitwise the same?"""
    mine = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()]).numpy()
    rows = commlib.allgather(np.ascontiguousarray(mine).view(np.uint32))
    return bool((rows == rows[0]).all())


def average_without_the_algorithm(ddp) -> None:
    """The parameters' average over the world, as average_parameters() did before the
    algorithm took part (queued corrections then land after it)."""
    params = list(ddp.module.parameters())
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        commlib.allreduce(flat, op=commlib.ReduceOp.AVG)
        offset = 0
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def wait_for_a_round(ddp, timeout: float = 2.0) -> None:
    """Best effort: let a round complete (so corrections are queued), then meet the other
    ranks (average_parameters() holds the averaging lock: no rank may still wait for a
    round while another is inside it)."""
    start, end = ddp.algorithm.rounds, time.monotonic() + timeout
    while ddp.algorithm.rounds == start and time.monotonic() < end:
        time.sleep(0.002)
    commlib.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--control", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    commlib.init()
    rank, n = commlib.get_rank(), commlib.get_world_size()
    ddp = make_ddp(1 if args.mode in ("average", "step_raises") else 5)
    KEEP.append(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    result: dict = {"rank": rank}

    if args.mode == "average":
        checks = []
        for i in range(args.steps):
            step(ddp, opt, rank, i)
            if i % 10 == 9:
                wait_for_a_round(ddp)  # corrections queued since the last forward
                if args.control:
                    average_without_the_algorithm(ddp)
                else:
                    ddp.average_parameters()
                right_after = identical(ddp)
                opt.zero_grad()
                ddp(torch.zeros(1, 64)).sum().backward()  # a training forward applies
                checks.append([right_after, identical(ddp)])  # queued corrections
        result.update(checks=checks, rounds=ddp.algorithm.rounds)
        ddp.close()
    elif args.mode == "step_raises":
        rounds_at_fault = None
        for i in range(args.steps):
            if i == 10 and rank == n - 1:
                def closure():
                    raise RuntimeError(f"rank {rank}: closure failed on purpose")
                try:
                    step(ddp, opt, rank, i, closure)
                except RuntimeError as exc:
                    print(f"rank {rank}: caught {exc}", flush=True)
                rounds_at_fault = ddp.algorithm.rounds
                continue
            step(ddp, opt, rank, i)
        time.sleep(0.5)  # rounds go on while every rank waits here
        commlib.barrier()
        result.update(rounds_at_fault=rounds_at_fault, rounds=ddp.algorithm.rounds)
        ddp.close()
    elif args.mode == "thread_fails":
        for i in range(args.steps):
            if i == 20 and rank == 1:
                def broken():
                    raise RuntimeError("rank 1: snapshot failed on purpose")
                ddp.algorithm._averager._snapshot = broken
            step(ddp, opt, rank, i)
            time.sleep(0.005)
    else:
        for i in range(args.steps):
            step(ddp, opt, rank, i)
        result.update(rounds=ddp.algorithm.rounds)
        if args.mode == "stuck":
            if rank == 1:
                inside = threading.Event()

                def stuck():
                    inside.set()
                    time.sleep(600)
                ddp.algorithm._averager._snapshot = stuck
                inside.wait(30)
            commlib.barrier()  # nobody stops averaging before rank 1's thread is stuck
    print(f"RESULT {json.dumps(result)}", flush=True)
    if args.mode == "sys_exit":
        sys.exit(0)
    if args.mode == "exception":
        raise RuntimeError(f"rank {rank}: the script ends with an exception on purpose")


if __name__ == "__main__":
    main()
