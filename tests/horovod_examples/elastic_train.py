"""A Horovod-style elastic training script (``hvd.elastic.run``, ``TorchState``,
``ElasticSampler``, ``batches_per_commit`` as in Horovod's elastic examples) on
``commlib.horovod``; driven by tests/test_horovod_elastic.py.

    COMMLIB_FAULT_TOLERANT=1 mpiexec -disable-auto-cleanup ... -n 3 \\
        python elastic_train.py OUTDIR [--victim R --at K] [--broken]

A float64 ``Linear(4, 1)`` with the loss ``model(x).sum()`` (its gradient is the sum of the
batch's integer features: exact in any summation order, so a replay is bit-exact) trained
by ``hvd.DistributedOptimizer(SGD with momentum)`` for 2 epochs of a 48-sample dataset,
2 samples per rank per step, a commit every 2 steps. Rank R SIGKILLs itself right after
its optimizer step of global step K (the others have applied it too, and have not
committed it). Each step, the step's global batch (every rank's indices, by
``allgather_object``) is appended to ``state.ledger`` (a tuple: the committed ledger is
the state's). ``--broken``: the sampler is left out of the state (so it is neither restored
nor re-dealt over the survivors). Every finishing rank writes ``OUTDIR/rank{r}.json``:
the ledger, the final weight (float64 hex), the world sizes seen by the reset callback.
"""
import argparse
import json
import os
import signal

import torch

import commlib.horovod as hvd

parser = argparse.ArgumentParser()
parser.add_argument("outdir")
parser.add_argument("--victim", type=int, default=-1)
parser.add_argument("--at", type=int, default=-1)
parser.add_argument("--broken", action="store_true")
args = parser.parse_args()

EPOCHS, LENGTH, BATCH, PER_COMMIT = 2, 48, 2, 2
torch.set_num_threads(1)
hvd.init()
world_rank = hvd.rank()
features = torch.randint(-4, 5, (LENGTH, 4), generator=torch.Generator().manual_seed(7)
                         ).double()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1, bias=False).double()
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.125,
                                                     momentum=0.5),
                                     named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(list(range(LENGTH)), shuffle=True, seed=1)
extra = {} if args.broken else {"sampler": sampler}
state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0, steps=0, ledger=(),
                               **extra)
sizes = []
state.register_reset_callbacks([lambda: sizes.append(hvd.size())])


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, EPOCHS):
        indices = list(sampler)
        for b in range(len(indices) // BATCH):
            mine = indices[b * BATCH:(b + 1) * BATCH]
            everyone = hvd.allgather_object(mine)
            optimizer.zero_grad()
            model(features[mine]).sum().backward()
            optimizer.step()
            if world_rank == args.victim and state.steps == args.at:
                os.kill(os.getpid(), signal.SIGKILL)
            sampler.record_batch(b, BATCH)
            state.steps += 1
            state.batch += 1
            state.ledger = state.ledger + ((state.epoch, hvd.size(), everyone),)
            if state.steps % PER_COMMIT == 0:
                state.commit()
        state.batch = 0
        sampler.set_epoch(state.epoch + 1)
        state.commit()


train(state)
with open(os.path.join(args.outdir, f"rank{world_rank}.json"), "w") as f:
    json.dump({"ledger": state.ledger, "sizes": sizes, "steps": state.steps,
               "weight": [float(w).hex() for w in model.weight.detach().reshape(-1)]}, f)
