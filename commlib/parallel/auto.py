"""One call from a model to a 3D-parallel trainer (Merak's non-intrusive API): the
``dp x pp x tp`` :class:`commlib.Topology`, the model cut into balanced pipeline stages by
:func:`commlib.pipeline.partition`, each stage's big Linear layers sharded over the
tensor-parallel group by :func:`shard_model`, and a :class:`commlib.pipeline.Pipeline`
over the pipeline group whose gradients are averaged over the data-parallel group."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ..base.errors import where
from ..base.reduce_ops import ReduceOp
from ..pipeline.executor import Pipeline
from ..pipeline.partitioner import Partition, partition
from ..services.topology import Topology
from .shard import shard_model


class AutoParallel(torch.nn.Module):
    """What :func:`auto` returns: this rank's part of the model and its trainer.

    ``topology`` (:class:`commlib.Topology`), ``partition`` (the
    :class:`commlib.pipeline.Partition`: every stage, with the cut), ``pipeline`` (the
    :class:`Pipeline` over ``topology.group("pp")``), ``ddp`` (with ``auto``'s
    ``algorithm``: this rank's stages' :class:`commlib.DistributedDataParallel`
    wrappers, e.g. for ``average_parameters()``; else empty). :meth:`parameters` are this rank's
    (its stages; sharded layers hold this rank's shard). :meth:`state_dict` is keyed by the
    names of the original model (this rank's stages only). :meth:`close` frees the
    pipeline's and the topology's communicators (collective over the world)."""

    def __init__(self, topology: Topology, parts: Partition, pipeline: Pipeline,
                 ddp: list | None = None) -> None:
        super().__init__()
        self.topology = topology
        self.partition = parts
        self.pipeline = pipeline
        self.ddp = list(ddp or [])  # this rank's stage wrappers (with ``algorithm``)

    def train_step(self, inputs: torch.Tensor, targets: Any) -> float:
        """One step on this data-parallel replica's batch (``inputs`` and ``targets`` the
        same on the ranks of its pipeline and tensor-parallel groups, batch first):
        forward and backward of every micro-batch by the schedule; ``.grad`` of
        :meth:`parameters` gets the gradient of the mean micro-batch loss averaged over the
        data-parallel replicas. Returns that loss averaged over the replicas (the same
        float on every rank)."""
        loss = self.pipeline.train_step(inputs, targets)
        dp = self.topology.group("dp")
        if dp.size == 1:
            return loss
        t = torch.tensor([loss], dtype=torch.float64)
        dp.allreduce(t, op=ReduceOp.AVG)
        return float(t[0])

    def eval_step(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model's output for ``inputs`` (the same on the ranks of this replica's
        pipeline and tensor-parallel groups), on each of those ranks."""
        return self.pipeline.eval_step(inputs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("commlib.parallel.auto: call train_step(inputs, targets) or "
                           "eval_step(inputs)")

    def state_dict(self, *args: Any, **kwargs: Any) -> OrderedDict[str, torch.Tensor]:
        """This rank's parameters and buffers by their names in the original model
        (detached; a sharded layer's entries are this rank's shard)."""
        out: OrderedDict = OrderedDict()
        for s in self.pipeline.local_ids:
            for name, t in self.partition[s].state_dict(keep_vars=True).items():
                out[name] = t.detach()
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Copy entries of :meth:`state_dict`'s form into this rank's stages; with
        ``strict``, every name of this rank must be present."""
        mine = self.state_dict()
        missing = [k for k in mine if k not in state_dict]
        if strict and missing:
            raise KeyError(f"{where('parallel.auto.load_state_dict', self.topology.rank)}: "
                           f"missing {missing}")
        with torch.no_grad():
            for name, t in mine.items():
                if name in state_dict:
                    t.copy_(state_dict[name])
        return missing

    def close(self) -> None:
        """Free the pipeline's and the topology's communicators (collective over the
        world; once)."""
        self.pipeline.close()
        for w in self.ddp:
            w.close()
        if self.topology._groups:
            self.topology.free()


def auto(model: torch.nn.Module, example_inputs: Any, pp: int = 1, tp: int = 1,
         dp: int | None = None, *, loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
         schedule: str = "1f1b", micro_batches: int = 4, chunks: int = 2,
         balance: str = "time", min_params: int = 1 << 20, order: str = "tp-pp-dp",
         poll_s: float | None = None, algorithm: Any = None,
         ddp_kwargs: dict | None = None) -> AutoParallel:
    """Train ``model`` over the world as ``dp x pp x tp`` ranks with one call.

    Collective over the world: every rank passes the same model (same weights) and
    example. Builds ``Topology(dp, pp, tp, order)`` (``dp=None``: the rest of the world),
    cuts ``model`` into ``pp`` stages (``pp * chunks`` under ``"interleaved"``) with
    :func:`commlib.pipeline.partition` (``balance``: ``"time"`` or ``"params"``; the model
    as a whole is measured before any sharding, on ``example_inputs``: one tensor, batch
    first), shards each stage's ``nn.Linear`` layers of at least ``min_params`` parameters
    over the tensor-parallel group (:func:`shard_model`; layers tied to others stay
    replicated), and runs them in a :class:`Pipeline` (``schedule``, ``micro_batches``,
    ``loss_fn(output, target)``) over the pipeline group, averaging gradients over the
    data-parallel group: by default a plain average after the schedule (``Pipeline``'s
    ``dp_group``); with ``algorithm`` (a name of ``commlib.algorithms.available()``, or a
    function of no arguments returning a new :class:`commlib.algorithms.Algorithm`: one
    per stage), each stage of this rank is wrapped in a
    :class:`commlib.DistributedDataParallel` over (its own communicator of) the
    data-parallel group with that algorithm and ``ddp_kwargs`` (e.g. ``{"sync_every":
    4}`` for ``local_sgd``, ``bucket_cap_mb``), which exchanges during the stage's last
    backward of each step; relaxed algorithms act at the steps of an optimizer over
    :meth:`AutoParallel.parameters`, as with DDP. The stages hold ``model``'s parameters
    (not copies; sharded layers are new modules).
    Returns an :class:`AutoParallel` (``train_step``, ``eval_step``, ``parameters``,
    ``state_dict``, ``close``)."""
    topo = Topology(dp=dp, pp=pp, tp=tp, order=order)
    try:
        count = pp * (chunks if schedule == "interleaved" else 1)
        parts = partition(model, count, example_inputs, balance=balance,
                          group=topo.group("pp"))
        if tp > 1:
            for stage in parts:
                shard_model(stage, topo.group("tp"), min_params=min_params)
        dp_group = topo.group("dp")
        stages, wrappers = list(parts), []
        if algorithm is not None and dp_group.size > 1:
            stages, wrappers = _wrap(parts, dp_group, schedule, micro_batches, chunks, topo,
                                     algorithm, ddp_kwargs or {})
        elif ddp_kwargs:
            raise ValueError(f"{where('parallel.auto', topo.rank)}: argument 'ddp_kwargs' "
                             f"needs argument 'algorithm'")
        pipe = Pipeline(stages, group=topo.group("pp"), schedule=schedule,
                        micro_batches=micro_batches, loss_fn=loss_fn, chunks=chunks,
                        dp_group=dp_group if dp_group.size > 1 and not wrappers else None,
                        poll_s=poll_s)
    except BaseException:
        for w in locals().get("wrappers", []):
            w.close()
        topo.free()
        raise
    return AutoParallel(topo, parts, pipe, wrappers)


def _wrap(parts: Partition, dp_group: Any, schedule: str, micro_batches: int, chunks: int,
          topo: Topology, algorithm: Any, kwargs: dict) -> tuple[list, list]:
    """This rank's stages with trainable parameters, each in a DistributedDataParallel
    over a communicator of its own on ``dp_group`` (the same stages on every replica, in
    the same order); the other stages stay as they are (they never run here)."""
    from ..ddp.wrapper import DistributedDataParallel
    from ..pipeline.schedule import generate
    pp_group = topo.group("pp")
    sched = generate(schedule, pp_group.size, micro_batches, chunks)
    mine = [s for s in sorted({s for _, s in sched.stages_of(pp_group.rank)})
            if any(p.requires_grad for p in parts[s].parameters())]
    if not isinstance(algorithm, str) and not callable(algorithm) and len(mine) > 1:
        raise ValueError(f"{where('parallel.auto', topo.rank)}: argument 'algorithm' is one "
                         f"Algorithm object but this rank runs {len(mine)} stages, each "
                         f"with an algorithm of its own: pass its name or a function "
                         f"returning a new one")
    stages, wrappers = list(parts), []
    for s in mine:
        algo = algorithm() if callable(algorithm) else algorithm
        ddp = DistributedDataParallel(parts[s], process_group=dp_group, algorithm=algo,
                                      **kwargs)
        wrappers.append(ddp)
        stages[s] = ddp
    return stages, wrappers
