"""Train an MLP on scikit-learn's 8x8 handwritten digits split into pipeline stages.

    mpiexec -n 4 python -m commlib.examples.train_pipeline --schedule chimera
    mpiexec -n 4 python -m commlib.examples.train_pipeline --schedule 1f1b --tp 2

The ranks form a ``Topology(dp, pp, tp)``: the model is cut into ``pp`` stages run by a
:class:`commlib.pipeline.Pipeline` (GPipe, 1F1B, interleaved or Chimera) over each
pipeline group; with ``--tp k`` the big Linear layers of every stage are sharded
SplitBrain/Megatron-style over the tensor-parallel group
(:func:`commlib.parallel.shard_model`); with ``dp > 1`` (``--pp`` smaller than the world
over ``tp``) pipeline replicas train on their own shards of each batch and average their
gradients. Rank 0 prints, per epoch, the mean loss, the training accuracy and samples/s,
then the test accuracy and each rank's parameter count. Same data as ``train_digits``.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

import commlib
from commlib.examples.train_digits import load_digits_split


def make_stages(count: int, hidden: int) -> list[nn.Module]:
    """``count`` stages of an MLP 64 -> hidden -> ... -> 10: one hidden layer per stage,
    the last stage two (its hidden layer and the classifier, sharded as a pair)."""
    stages = []
    for s in range(count):
        layers: list[nn.Module] = [nn.Flatten()] if s == 0 else []
        layers += [nn.Linear(64 if s == 0 else hidden, hidden), nn.ReLU()]
        if s == count - 1:
            layers.append(nn.Linear(hidden, 10))
        stages.append(nn.Sequential(*layers))
    return stages


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", default="1f1b", choices=commlib.pipeline.SCHEDULES)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel group size (1)")
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline ranks (default: world size / tp)")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="global batch (64)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    commlib.init()
    rank, n = commlib.get_rank(), commlib.get_world_size()
    pp = args.pp or n // args.tp
    topo = commlib.Topology(pp=pp, tp=args.tp)
    dp = topo.sizes["dp"]
    chunks = 2 if args.schedule == "interleaved" else 1
    torch.manual_seed(args.seed)
    stages = make_stages(pp * chunks, args.hidden)
    if args.tp > 1:
        for stage in stages:
            commlib.parallel.shard_model(stage, topo.group("tp"),
                                         min_params=10 * args.hidden)
    pipe = commlib.pipeline.Pipeline(stages, group=topo.group("pp"), schedule=args.schedule,
                                     micro_batches=args.micro_batches,
                                     loss_fn=nn.functional.cross_entropy, chunks=chunks,
                                     dp_group=topo.group("dp") if dp > 1 else None)
    opt = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    train, test = load_digits_split(args.seed)
    x_all, y_all = train.tensors
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{n} ranks: dp={dp} x pp={pp} x tp={args.tp}, schedule {args.schedule}, "
        f"{args.micro_batches} micro-batches, bubble fraction "
        f"{pipe.schedule.bubble_fraction:.3f} (ideal timeline)")
    per = args.batch // dp
    for epoch in range(args.epochs):
        order = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(epoch))
        loss_sum, steps, start = 0.0, 0, time.perf_counter()
        for i in range(0, len(order) - args.batch + 1, args.batch):
            idx = order[i + topo.coord.dp * per: i + (topo.coord.dp + 1) * per]
            opt.zero_grad()
            loss_sum += pipe.train_step(x_all[idx], y_all[idx])
            opt.step()
            steps += 1
        seconds = time.perf_counter() - start
        out = pipe.eval_step(x_all)
        acc = (out.argmax(1) == y_all).double().mean().item()
        say(f"epoch {epoch + 1}: loss {loss_sum / steps:.4f}, train accuracy {acc:.3f}, "
            f"{steps * args.batch / seconds:.0f} samples/s")
    x_test, y_test = test.tensors
    acc = (pipe.eval_step(x_test).argmax(1) == y_test).double().mean().item()
    mine = sum(q.numel() for q in pipe.parameters())
    counts = commlib.allgather(torch.tensor([mine]))[:, 0].tolist()
    whole = sum(q.numel() for s in make_stages(pp * chunks, args.hidden) for q in s.parameters())
    say(f"test accuracy {acc:.3f}; parameters per rank {counts} (whole model {whole})")
    pipe.close()
    topo.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
