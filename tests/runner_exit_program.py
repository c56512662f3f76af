"""A torch DDP training script on its exit paths under the runner (``python -m commlib``,
run by test_runner_exits.py), written as third-party clients are: ``init_process_group()``
and torch's ``DistributedDataParallel``, no commlib import.

``MODE`` (argv[1]), what rank 1 does at step 3 while rank 0 trains on:

* ``exit1``: a bare ``sys.exit(1)`` (nanoGPT's shape);
* ``framework``: raises inside ``main()``, which a framework wrapper turns into a printed
  traceback and ``sys.exit(1)`` (hydra's ``run_job``: minGPT-ddp's shape);
* ``exit0``: ``sys.exit(0)``, a clean-looking exit of one rank;
* ``raise``: an uncaught exception;
* ``slow``: nothing: every rank trains to the end, then rank 0 evaluates alone for longer
  than the exit window before its script ends (a legitimate late end, the negative control:
  the job must end with status 0 and the replicas averaged);
* ``none``: every rank trains to the end.

Every rank prints ``SHM [names]`` after init; a leaving rank prints ``LEAVING <time>``
(``time.time()``) just before it leaves; ``END rank R sha`` from an ``atexit`` handler
(after the runner's end-of-script sync point).
"""
import atexit
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import shm_segments  # noqa: E402

MODE = sys.argv[1] if len(sys.argv) > 1 else "none"
STEPS = 40


def leave(code: int) -> None:
    print(f"LEAVING {time.time():.3f}", flush=True)
    sys.exit(code)


def main() -> None:
    dist.init_process_group()
    rank = dist.get_rank()
    print(f"SHM {json.dumps(shm_segments())}", flush=True)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 64)).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)

    def report() -> None:
        flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
        print(f"\nEND rank {rank} {hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]}",
              flush=True)

    atexit.register(report)
    for step in range(STEPS):
        if rank == 1 and step == 3:
            if MODE in ("exit1", "exit0"):
                leave(int(MODE[-1]))
            if MODE in ("framework", "raise"):
                print(f"LEAVING {time.time():.3f}", flush=True)
                raise RuntimeError("rank 1 failed on purpose")
        opt.zero_grad()
        model(torch.randn(16, 64, generator=g, dtype=torch.float64)).square().mean().backward()
        opt.step()
        time.sleep(0.02)
    if MODE == "slow" and rank == 0:
        time.sleep(float(os.environ.get("COMMLIB_EXIT_WINDOW", "10")) + 3)
    print(f"rank {rank} finished", flush=True)


if MODE == "framework":
    try:
        main()
    except Exception:  # hydra's run_job: print the traceback, exit 1
        import traceback
        traceback.print_exc()
        sys.exit(1)
else:
    main()
