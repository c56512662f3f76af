"""ZeRO stage 1 in elastic training under a real failure, and its single-process reference;
driven by test_elastic_zero.py and benchmarks/bench_elastic_zero.py.

Usage::

    mpiexec ... python elastic_zero_program.py OUTDIR [--optimizer adam|sgd] [--steps N]
        [--victim R] [--at K] [--when backward|commit] [--lose-replica]
    python elastic_zero_program.py OUTDIR --reference [--optimizer adam|sgd] [--steps N]

A float64 MLP trained through ``commlib.elastic`` (``State``, ``run``, ``ElasticSampler``:
the global batch of 24 samples of each step split over the ranks alive) with a
``commlib.ZeroRedundancyOptimizer`` of ``torch.optim.Adam`` (or SGD with momentum) behind
``state.wrap(algorithm="gradient_allreduce")``, optimizer buckets of 40 elements (the
shards cut through parameters). Rank ``R`` is SIGKILLed in the middle of the backward of
step ``K``; the survivors rebuild its optimizer shard from the replica on rank ``R + 1``
and go on over a new partition. ``--when commit``: rank ``R`` dies in step ``K``'s commit
instead, before sending its replica (the replica exchange is nonblocking: the others
recorded that commit, and its successor, lacking the replica, goes back one commit with
everyone). ``--lose-replica``: the rebuild ignores the replicas (the
dead rank's elements restart without optimizer state): wrong on purpose, the negative
control. Every rank that finishes writes ``OUTDIR/rank{r}.json`` (the step, the ledger of
the group size that applied each step, the recoveries, the parameters as float64 bytes in
hex, the replica's bytes per commit); every rank writes ``OUTDIR/shm{r}.json``.

``--reference`` (one process, no MPI): torch's optimizer over the same model on each
global batch once (the mean loss over the 24 samples): what ZeRO with averaged gradients
computes at any group size, up to rounding; written to ``OUTDIR/reference.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal

import torch

parser = argparse.ArgumentParser()
parser.add_argument("outdir")
parser.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--victim", type=int, default=1)
parser.add_argument("--at", type=int, default=12)
parser.add_argument("--lose-replica", action="store_true")
parser.add_argument("--when", default="backward", choices=["backward", "commit"])
parser.add_argument("--reference", action="store_true")
args = parser.parse_args()
if not args.reference:
    os.environ["COMMLIB_FAULT_TOLERANT"] = "1"

torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)
BATCH, LENGTH = 24, 24 * 40
g = torch.Generator().manual_seed(1234)
X = torch.randn(LENGTH, 16, generator=g)
Y = torch.randn(LENGTH, 4, generator=g)
OPTIMIZERS = {"adam": (torch.optim.Adam, {"lr": 0.01}),
              "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def flat(model: torch.nn.Module) -> str:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]
                     ).numpy().tobytes().hex()


cls, kwargs = OPTIMIZERS[args.optimizer]
if args.reference:
    from commlib.elastic.sampler import ElasticSampler
    sampler = ElasticSampler(LENGTH, BATCH, seed=7)
    model = make_model()
    opt = cls(model.parameters(), **kwargs)
    for step in range(args.steps):
        idx = sampler.global_batch(step).tolist()
        torch.nn.functional.mse_loss(model(X[idx]), Y[idx]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with open(os.path.join(args.outdir, "reference.json"), "w") as f:
        json.dump({"params": flat(model), "steps": args.steps}, f)
    raise SystemExit(0)

import commlib  # noqa: E402
from commlib import elastic  # noqa: E402
from commlib.elastic import zero as zero_elastic  # noqa: E402
from elastic_common import write_shm  # noqa: E402

commlib.init(fault_tolerant=True)
me = commlib.get_rank()
write_shm(args.outdir, me)
zero_elastic._LOSE_REPLICA = args.lose_replica
model = make_model()
zero = commlib.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls,
                                       bucket_cap_mb=40 * 8 / (1 << 20), **kwargs)
sampler = elastic.ElasticSampler(LENGTH, BATCH, seed=7)
state = elastic.State(model, zero, sampler, ledger=[])


def train(st: elastic.State) -> None:
    ddp = st.wrap(algorithm="gradient_allreduce", bucket_cap_mb=0.005)
    while st.step < args.steps:
        step, group = st.step, st.group
        idx = sampler.indices(step, group.rank, group.size)
        out = ddp(X[idx])
        if me == args.victim and step == args.at and args.when == "commit":
            # dies in this step's commit, before sending its replica (the others recorded
            # the commit; its successor never receives the replica)
            zero_elastic._BEFORE_SEND = lambda: os.kill(os.getpid(), signal.SIGKILL)
        if me == args.victim and step == args.at and args.when == "backward":
            hidden = out.grad_fn.next_functions[1][0]  # dies mid-backward
            hidden.register_hook(lambda *a: os.kill(os.getpid(), signal.SIGKILL))
        torch.nn.functional.mse_loss(out, Y[idx]).backward()
        zero.step()
        zero.zero_grad(set_to_none=True)
        st.ledger.append([step + 1, group.size])
        st.commit()


elastic.run(train, state)
with open(os.path.join(args.outdir, f"rank{me}.json"), "w") as f:
    json.dump({"rank": me, "step": state.step, "ledger": state.ledger,
               "recoveries": [{k: (v if k != "values" else {str(a): b for a, b in v.items()})
                               for k, v in r.items()} for r in state.recoveries],
               "params": flat(model), "size": state.group.size,
               "replica_bytes": state.replica_bytes,
               "shard": zero.shard_numel[zero.rank]}, f)
