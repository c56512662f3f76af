"""A LightningModule trained by several strategies in one MPI job (``mpiexec -n N python
lightning_program.py RUN ...``), each run from the same seed, in float64:

* ``ref``: Lightning's ``DDPStrategy`` over gloo (torch's DDP): the reference;
* ``torch_commlib``: ``DDPStrategy(process_group_backend="commlib")`` (torch's DDP over
  commlib's backend);
* ``commlib:ALGO``: ``CommlibStrategy(algorithm=ALGO)`` (``commlib`` alone: the registered
  name, ``strategy="commlib"``);
* ``sum``: ``CommlibStrategy(algorithm="gradient_allreduce", average=False)``, a negative
  control that must not match the reference;
* ``noavg:local_sgd``: ``CommlibStrategy(local_sgd)`` with its averaging switched off, a
  negative control whose replicas must differ.

Every run logs with ``sync_dist=True`` (training and validation), checkpoints every epoch
(``ModelCheckpoint``) and validates every epoch. Each rank prints, per run, ``LIGHTNING
{json}`` lines: the SHA-256 of its replica in every checkpoint it took (``ckpt``), at the
end of ``fit`` (``end``), and the largest difference from the reference's parameters
(``ref_diff``) and how many ``RelaxedReplicaWarning`` it got during ``fit`` (``relaxed_warnings``:
a state dict of replicas that differ); the test compares the ranks' lines.
"""
import hashlib
import json
import os
import sys
import tempfile
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import commlib  # registers strategy="commlib"
from commlib.ddp import RelaxedReplicaWarning
from commlib.integrations.lightning import CommlibStrategy

RANK = commlib.get_rank()


def sha(state):
    digest = hashlib.sha256()
    for name, t in state.items():
        digest.update(name.encode())
        digest.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def report(**fields):
    print("\nLIGHTNING " + json.dumps(dict(rank=RANK, **fields)), flush=True)


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y),
                 sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.5)


class Measure(Callback):
    """Each rank's replica, as every checkpoint holds it."""

    def __init__(self, run):
        self.run = run

    def on_train_start(self, trainer, pl_module):
        trainer.wrapper = f"{type(trainer.strategy.model).__module__}." \
                          f"{type(trainer.strategy.model).__name__}"

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        report(run=self.run, what="ckpt", epoch=checkpoint["epoch"],
               sha=sha(checkpoint["state_dict"]))


class NoAveraging(CommlibStrategy):
    """Negative control: the strategy without its sync points."""

    def average_parameters(self):
        return False


def data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 6, generator=g, dtype=torch.float64)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 0.5).long()
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)


def strategy(run):
    kind, _, algo = run.partition(":")
    if kind == "ref":
        return DDPStrategy(process_group_backend="gloo"), commlib.get_world_size()
    if kind == "torch_commlib":
        return DDPStrategy(process_group_backend="commlib"), commlib.get_world_size()
    if kind == "sum":
        return CommlibStrategy(algorithm="gradient_allreduce", average=False), "auto"
    extra = {"sync_every": 5} if algo == "local_sgd" else {}
    if kind == "noavg":
        return NoAveraging(algorithm=algo, **extra), "auto"
    if not algo:
        return "commlib", "auto"  # the registered name
    return CommlibStrategy(algorithm=algo, **extra), "auto"


def fit(run, root):
    L.seed_everything(0, verbose=False)
    model = Net()
    initial = sha({k: v.double() for k, v in model.state_dict().items()})
    chosen, devices = strategy(run)
    if os.environ.get("LIGHTNING_DEVICES"):  # torchrun: Lightning wants --nproc-per-node
        devices = int(os.environ["LIGHTNING_DEVICES"])
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=chosen, max_epochs=2,
                        precision="64-true", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root,
                        callbacks=[ModelCheckpoint(dirpath=os.path.join(root, run),
                                                   save_top_k=-1, every_n_epochs=1),
                                   Measure(run)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RelaxedReplicaWarning)
        trainer.fit(model, data(), data())
    trainer.relaxed_warnings = 0
    for w in caught:
        if issubclass(w.category, RelaxedReplicaWarning):
            trainer.relaxed_warnings += 1
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.distributed.destroy_process_group()
    return trainer, state, initial


def main(runs):
    root = os.environ.get("LIGHTNING_PROGRAM_ROOT") or tempfile.gettempdir()
    reference = None
    for run in runs:
        trainer, state, initial = fit(run, root)
        if run == "ref":
            reference = state
        diff = None if reference is None else max(
            (state[k] - reference[k]).abs().max().item() for k in reference)
        report(run=run, what="end", sha=sha(state), initial=initial, ref_diff=diff,
               logged=sorted(trainer.callback_metrics), wrapper=trainer.wrapper,
               relaxed_warnings=trainer.relaxed_warnings,
               strategy=type(trainer.strategy).__name__)


if __name__ == "__main__":
    main(sys.argv[1:])
