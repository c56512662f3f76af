"""A torch DDP script without epochs, sampler or process group, for ``mpiexec -n N python -m
commlib --algorithm local_sgd ...``: 7 steps on per-rank data, the model kept alive by an
``atexit`` handler that prints ``END rank R sha`` (so it sees the model after the runner's
end-of-script sync point). ``END_EXIT=s`` ends with ``sys.exit(s)``."""
import atexit
import hashlib
import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

rank = int(os.environ["RANK"])
model = DDP(torch.nn.Linear(4, 2).double())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
for _ in range(7):
    opt.zero_grad()
    model(torch.randn(8, 4, generator=g, dtype=torch.float64)).square().mean().backward()
    opt.step()


def report():
    flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    print(f"\nEND rank {rank} {hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]}",
          flush=True)


atexit.register(report)
sys.exit(int(os.environ.get("END_EXIT", "0")))
