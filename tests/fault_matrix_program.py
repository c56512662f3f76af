"""One cell of the fault matrix: train a small model with one algorithm and inject one fault
on one rank; driven by test_fault_matrix.py under ``mpiexec``.

Usage: python fault_matrix_program.py ALGORITHM FAULT [--step K] [--steps N] [--rank R]
       python fault_matrix_program.py ALGORITHM nan+step_raises [--step K] ...

The model (four linear layers, ``bucket_cap_mb`` small) spans several gradient buckets;
the fault happens on rank R (default: the last rank) at step K (default 12 of 30), after
that step's backward, i.e. with the step's exchanges done and its optimizer step pending:

``raise``        R raises RuntimeError (uncaught)
``exit``         R calls ``sys.exit(3)``
``kill``         R sends itself SIGKILL
``nan``          R's loss is multiplied by NaN before backward; every rank skips the
                 optimizer step when one of its own gradients is not finite, exactly as
                 ``torch.amp.GradScaler`` does (scale 1: loss scaling would change the
                 math of qadam and K-FAC, which is not what this matrix tests)
``step_raises``  ``optimizer.step`` raises on R (its closure raises before any update);
                 the program catches the exception and goes on training
``noclose``      no fault; the script ends without ``close()`` (nor any collective after
                 the last step)
``nan+step_raises``  both faults that training survives, in one job (CI time: one process
                 start-up less): ``nan`` at step K, ``step_raises`` at step K + 8 (the same
                 phase of every algorithm's schedule: sync_every and update intervals
                 divide 8)

Lines printed for the test: ``SHM [names]`` on every rank after ``init`` (the MPICH
shared-memory segments it maps: the job must leave none in ``/dev/shm``), ``FAULT {json}``
on R right before a fault that ends the process, and ``RESULT {json}`` on every rank that
finishes: the steps it skipped, whether
its parameters are finite, whether they changed after step K (training went on;
``changed_after``: for each fault's step), digests of its parameters at the end of training,
right before each fault's step (``digest_before``) and, except for ``noclose``, after
``average_parameters()`` followed by one more training forward and backward without an
optimizer step (which applies anything an algorithm left pending before a forward).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

import commlib
from helpers import mpich_segments

FAULTS = ("raise", "exit", "kill", "nan", "step_raises", "noclose")
SECOND_FAULT_AFTER = 8  # steps between the two faults of "nan+step_raises"

# Each algorithm's interesting phase active by the time of the fault.
KWARGS = {
    "gradient_allreduce": {},
    "bytegrad": {"chunk_size": 256},
    "qadam": {"warmup_steps": 4, "chunk_size": 256},  # compressed (sign1) from step 4
    "decentralized": {"peer_selection_mode": "shift_one"},
    "low_precision_decentralized": {"chunk_size": 256},
    "local_sgd": {"sync_every": 4},
    "async_model_average": {"sync_interval_ms": 2, "warmup_steps": 0},  # rounds in flight
    "d_kfac": {"lr": 0.05, "factor_update_steps": 2, "inv_update_steps": 4},
    "dp_kfac": {"lr": 0.05, "factor_update_steps": 2, "inv_update_steps": 4},
    "diloco": {"sync_every": 4},                      # outer steps at 4, 8, 12 (the fault's)
    "streaming_diloco": {"sync_every": 4, "num_fragments": 2, "fragment_sync_delay": 1,
                         "quantize": "int4"},         # an exchange in flight at step 12
    "powersgd": {"rank": 2, "start_iter": 4},         # compressed from step 4
    # outer steps (allgathers of top-k messages) at 4, 8, 12 (the fault's)
    "sparseloco": {"sync_every": 4, "density": 0.1, "chunk_size": 256},
    "muloco": {"sync_every": 4},                      # int2 messages at 4, 8, 12
    "demo": {"chunk_size": 16, "topk": 4},            # top-k DCT coefficients every step
}
BUCKET_CAP_MB = 0.01  # ~10 KB: the 44 KB model spans 6 buckets


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 10))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def optimizer(algorithm: str, params) -> torch.optim.Optimizer:
    if algorithm == "qadam":
        from commlib.algorithms.qadam import QAdamOptimizer
        return QAdamOptimizer(params, lr=0.01)
    if algorithm == "demo":  # DeMo's update is sign(...): plain SGD, a small step
        return torch.optim.SGD(params, lr=0.005)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def digest(module: torch.nn.Module) -> str:
    return hashlib.sha256(flat(module).numpy().tobytes()).hexdigest()[:16]


def announce(kind: str, **fields) -> None:
    print(f"{kind} {json.dumps(fields)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("algorithm", choices=sorted(KWARGS))
    parser.add_argument("fault", choices=FAULTS + ("nan+step_raises",))
    parser.add_argument("--step", type=int, default=12)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rank", type=int, default=-1)
    args = parser.parse_args()

    torch.set_num_threads(1)
    commlib.init()
    rank, n = commlib.get_rank(), commlib.get_world_size()
    print(f"SHM {json.dumps(mpich_segments())}", flush=True)  # none may be left behind
    bad = (args.rank % n) == rank
    k = args.step
    faults = args.fault.split("+")
    at = {f: k + i * SECOND_FAULT_AFTER for i, f in enumerate(faults)}  # fault -> its step

    ddp = commlib.DistributedDataParallel(model(), algorithm=args.algorithm,
                                          bucket_cap_mb=BUCKET_CAP_MB,
                                          **KWARGS[args.algorithm])
    opt = optimizer(args.algorithm, ddp.parameters())
    skipped, failed, losses = [], [], []
    after, before = {}, {}  # fault step -> parameters after it / digest right before it

    def fault(kind: str) -> bool:
        if bad and kind in at and step == at[kind]:
            if kind in ("raise", "exit", "kill"):
                announce("FAULT", rank=rank, step=k, fault=kind, time=time.time())
            return True
        return False

    for step in range(args.steps):
        if step in at.values():
            before[step] = digest(ddp.module)
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        if fault("nan"):
            loss = loss * float("nan")
        loss.backward()
        losses.append(loss.item())
        if fault("raise"):
            raise RuntimeError(f"rank {rank} failed on purpose at step {k}")
        if fault("exit"):
            sys.exit(3)
        if fault("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        if not all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters()
                   if p.grad is not None):
            skipped.append(step)  # GradScaler-style: no optimizer step
        elif fault("step_raises"):
            def closure():
                raise RuntimeError(f"rank {rank}: closure failed on purpose at step {k}")
            try:
                opt.step(closure)
            except RuntimeError as exc:
                failed.append(step)
                print(f"rank {rank}: caught {exc}", flush=True)
        else:
            opt.step()
        if step in at.values():
            after[step] = flat(ddp.module).clone()

    changed = {str(s): not torch.equal(p, flat(ddp.module)) for s, p in after.items()}
    result = dict(rank=rank, skipped=skipped, failed=failed,
                  finite=bool(torch.isfinite(flat(ddp.module)).all()),
                  changed_after_fault=changed[str(k)], changed_after=changed,
                  digest_before={str(s): d for s, d in before.items()},
                  loss_first=losses[0], loss_last=losses[-1], digest_end=digest(ddp.module))
    if args.fault != "noclose":
        ddp.average_parameters()
        x, y = batch(rank, args.steps)
        opt.zero_grad()  # a training forward (and its backward, without a step) applies
        F.cross_entropy(ddp(x), y).backward()  # what an algorithm left pending
        result["digest_avg"] = digest(ddp.module)
        ddp.close()
    announce("RESULT", **result)


if __name__ == "__main__":
    main()
