"""Rank 1 leaves with ``sys.exit(1)`` at step 3 while rank 0 trains on, under a framework
(``mpiexec -n 2 python framework_exit_program.py FRAMEWORK [ALGORITHM]``, run by
``test_framework_exits.py``):

* ``lightning``: ``Trainer(strategy=CommlibStrategy(algorithm=ALGORITHM))``; rank 1 calls
  ``sys.exit(1)`` inside ``training_step`` (Lightning catches the ``SystemExit``, runs its
  exception hooks and teardown, and re-raises it);
* ``accelerate``: the one-edit recipe (``init_process_group("commlib")`` before
  ``Accelerator()``, torch's DDP over commlib's backend); rank 1 calls ``sys.exit(1)`` in
  the loop;
* ``accelerate_runner``: the same loop without the edit, under ``python -m commlib
  --algorithm ALGORITHM`` (commlib's DDP).

Every rank prints ``SHM [names]`` once initialized; rank 1 prints ``LEAVING <time>``
(``time.time()``) just before it leaves; a rank that trains to the end prints ``rank R
finished`` (it must not: rank 0 cannot finish without rank 1).
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import shm_segments  # noqa: E402

FRAMEWORK = sys.argv[1]
ALGORITHM = sys.argv[2] if len(sys.argv) > 2 else "gradient_allreduce"
STEPS = 40
LEAVE_AT = 3


def leave() -> None:
    print(f"LEAVING {time.time():.3f}", flush=True)
    sys.exit(1)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16 * STEPS * 2, 64, generator=g, dtype=torch.float64)
    return DataLoader(TensorDataset(x, x.flip(1)), batch_size=16)


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 64)).double()


def lightning() -> None:
    import lightning as L

    from commlib.integrations.lightning import CommlibStrategy

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()

        def training_step(self, batch, batch_idx):
            if self.global_rank == 1 and batch_idx == LEAVE_AT:
                leave()
            time.sleep(0.02)
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_train_start(self) -> None:
            print(f"SHM {json.dumps(shm_segments())}", flush=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    trainer = L.Trainer(accelerator="cpu", strategy=CommlibStrategy(algorithm=ALGORITHM),
                        max_epochs=1, precision="64-true", logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(Net(), data())
    print(f"rank {trainer.global_rank} finished", flush=True)


def accelerate() -> None:
    if FRAMEWORK == "accelerate":
        dist.init_process_group("commlib")  # the one edit
    from accelerate import Accelerator
    accelerator = Accelerator()
    rank = accelerator.process_index
    print(f"SHM {json.dumps(shm_segments())}", flush=True)
    model = accelerator.prepare(net())
    opt, loader = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.05), data())
    for step, (x, y) in enumerate(loader):
        if rank == 1 and step == LEAVE_AT:
            leave()
        opt.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        time.sleep(0.02)
    print(f"rank {rank} finished", flush=True)


if __name__ == "__main__":
    lightning() if FRAMEWORK == "lightning" else accelerate()
