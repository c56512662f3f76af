"""Construct, train and close compressed-allreduce algorithms many times in one process;
driven by test_workspaces.py. Run with MPI initialized below MPI_THREAD_MULTIPLE
(``MPI4PY_RC_THREAD_LEVEL=serialized``): the wrapper then exchanges on the main thread,
whose workspace cache outlives every wrapper. Prints the bytes that cache holds after
each close; every rank exits 1 if they ever grow.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import commlib  # noqa: E402
from commlib.algorithms.qadam import QAdamOptimizer  # noqa: E402
from commlib.primitives.compressed import workspace_bytes  # noqa: E402


def main(cycles: int) -> None:
    torch.set_num_threads(1)
    commlib.init()
    assert not commlib.core.runtime.thread_multiple(), "run with MPI4PY_RC_THREAD_LEVEL=serialized"
    held = []
    for cycle in range(cycles):
        width = 8 + cycle  # a new bucket shape every cycle: a new workspace every cycle
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(),
                                     torch.nn.Linear(width, 4))
        if cycle % 2:
            ddp = commlib.DistributedDataParallel(module, algorithm="bytegrad")
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        else:
            ddp = commlib.DistributedDataParallel(module, algorithm="qadam", warmup_steps=0)
            opt = QAdamOptimizer(ddp.parameters(), lr=0.01)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(commlib.get_rank()))
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(ddp(x), torch.zeros(8, dtype=torch.long)).backward()
            opt.step()
        assert workspace_bytes() > 0, "the exchange did not run on this thread"
        ddp.close()
        held.append(workspace_bytes())
    print(f"rank {commlib.get_rank()}: bytes held after each close: {held}", flush=True)
    sys.exit(0 if max(held) == 0 else 1)


if __name__ == "__main__":
    main(int(sys.argv[1]))
