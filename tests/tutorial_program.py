"""A torchrun-style training script, written the way PyTorch's DDP tutorial
(ddp-tutorial-series/multigpu_torchrun.py) writes one, with only the DDP import changed:

    from torch.nn.parallel import DistributedDataParallel as DDP   # before
    from commlib import DistributedDataParallel as DDP             # after

env:// rendezvous (``init_process_group()`` with no arguments: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT come from MPI once commlib is imported), ``DistributedSampler``,
``DDP(model, device_ids=None)``, snapshots saved by rank 0 every epoch and resumed from.
Launch: ``mpiexec -n N python tutorial_program.py EPOCHS SNAPSHOT``. At the end it checks that
every rank holds the same parameters (``all_gather_object`` over torch.distributed) and
prints the SHA-256 of their bytes (a short line that other ranks' output cannot split) so
a test can compare a resumed run with an uninterrupted one bit for bit.
"""
import argparse
import hashlib
import os

import torch
import torch.nn.functional as F
from torch.distributed import all_gather_object, destroy_process_group, init_process_group
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from commlib import DistributedDataParallel as DDP


class Trainer:
    def __init__(self, model, train_data, optimizer, snapshot_path):
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.model = DDP(self.model, device_ids=None)
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)

    def _load_snapshot(self, path):
        snapshot = torch.load(path, map_location="cpu")
        self.model.module.load_state_dict(snapshot["MODEL_STATE"])
        if not os.environ.get("TUTORIAL_FORGET_OPTIMIZER"):  # the test's negative control
            self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        if "ALGORITHM_STATE" in snapshot and hasattr(self.model, "algorithm"):
            self.model.algorithm.load_state_dict(snapshot["ALGORITHM_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"[rank {self.global_rank}] resuming from epoch {self.epochs_run}", flush=True)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(),
                    "OPTIMIZER_STATE": self.optimizer.state_dict(),
                    "EPOCHS_RUN": epoch + 1}
        if hasattr(self.model, "algorithm"):
            snapshot["ALGORITHM_STATE"] = self.model.algorithm.state_dict()
        torch.save(snapshot, self.snapshot_path)

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0:
                self._save_snapshot(epoch)


def main(total_epochs, snapshot_path):
    init_process_group()
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(192, 20, generator=generator, dtype=torch.float64),
                            torch.randint(0, 4, (192,), generator=generator))
    train_data = DataLoader(dataset, batch_size=16, shuffle=False,
                            sampler=DistributedSampler(dataset))
    torch.manual_seed(int(os.environ["RANK"]))  # DDP starts every rank from rank 0's weights
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = Trainer(model, train_data, optimizer, snapshot_path)
    trainer.train(total_epochs)
    flat = torch.cat([p.detach().reshape(-1) for p in trainer.model.module.parameters()])
    everyone = [None] * int(os.environ["WORLD_SIZE"])
    all_gather_object(everyone, flat)
    identical = all(torch.equal(other, flat) for other in everyone)
    print(f"[rank {os.environ['RANK']}] replicas identical: {identical}", flush=True)
    if os.environ["RANK"] == "0":
        print("FINAL " + hashlib.sha256(flat.numpy().tobytes()).hexdigest(), flush=True)
    del trainer  # DDP models go before the process group (as torch's own DDP needs)
    destroy_process_group()
    if not identical:
        raise SystemExit(3)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="torchrun-style training, run by mpiexec")
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("snapshot_path")
    args = parser.parse_args()
    main(args.total_epochs, args.snapshot_path)
