"""Deliberately broken algorithms: negative controls that every convergence and consistency
test must reject. Each one either never communicates or communicates the wrong thing."""
from __future__ import annotations

from typing import Any

import torch

from commlib.algorithms import WEIGHTS, Algorithm
from commlib.algorithms.async_model_average import AsyncModelAverage
from commlib.algorithms.buckets import pack, unpack
from commlib.algorithms.bytegrad import ByteGrad
from commlib.algorithms.decentralized import Decentralized
from commlib.algorithms.gradient_allreduce import GradientAllReduce
from commlib.algorithms.local_sgd import LocalSGD
from commlib.algorithms.low_precision_decentralized import REPLICAS, LowPrecisionDecentralized
from commlib.algorithms.qadam import QAdam
from commlib.base.reduce_ops import ReduceOp
from commlib.primitives import allreduce

DROPPED = 0  # the bucket the "drop a bucket" controls never exchange: the output layer's


class SilentGradients(Algorithm):
    """Never communicates: every rank steps on its own gradients."""


class SilentWeights(Algorithm):
    """Never communicates: every rank keeps its own weights."""

    exchanges = WEIGHTS


class DropBucketGradients(GradientAllReduce):
    """Averages every gradient bucket but one."""

    def on_bucket_ready(self, ctx, bucket):
        return None if bucket.index == DROPPED else super().on_bucket_ready(ctx, bucket)


class StaleGradients(GradientAllReduce):
    """Averages the previous iteration's gradients instead of this one's."""

    def __init__(self) -> None:
        super().__init__()
        self._previous: dict[int, torch.Tensor] = {}

    def on_bucket_ready(self, ctx, bucket):
        current = bucket.flat.clone()
        previous = self._previous.get(bucket.index)
        self._previous[bucket.index] = current
        if previous is not None:
            bucket.flat.copy_(previous)
        return super().on_bucket_ready(ctx, bucket)


class DropBucketByteGrad(ByteGrad):
    def on_bucket_ready(self, ctx, bucket):
        return None if bucket.index == DROPPED else super().on_bucket_ready(ctx, bucket)


class DropBucketQAdam(QAdam):
    """Updates every bucket's momentum but exchanges one of them only locally."""

    def on_bucket_ready(self, ctx, bucket):
        if self.compressing and bucket.index == DROPPED:
            with torch.no_grad():
                m = self._momentum[bucket.index]
                self._update_momentum(bucket, m, m)
            return None
        return super().on_bucket_ready(ctx, bucket)


class SilentQAdam(QAdam):
    """qadam that, after the warm-up, keeps every momentum local."""

    def on_bucket_ready(self, ctx, bucket):
        if self.compressing:
            with torch.no_grad():
                m = self._momentum[bucket.index]
                self._update_momentum(bucket, m, m)
            return None
        return super().on_bucket_ready(ctx, bucket)


class DropBucketDecentralized(Decentralized):
    def _exchange(self, ctx, flats, step):
        for k, flat in enumerate(flats):
            if k != DROPPED:
                super()._exchange(ctx, [flat], step)


class StaleDecentralized(Decentralized):
    """Averages the snapshot of the previous communicating iteration."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._old: list[torch.Tensor] | None = None

    def before_forward(self, ctx):
        step = ctx.step
        if step % self.communication_interval or self._snapshot_step == step:
            return
        self._snapshot_step = step
        flats = [pack(b) for b in ctx.buckets]
        current = [f.clone() for f in flats]
        if self._old is not None:
            for f, old in zip(flats, self._old):
                f.copy_(old)
        self._old = current
        self._pending = ctx.submit(self._exchange, ctx, flats, step)


class DropBucketLocalSGD(LocalSGD):
    def _average(self, ctx):
        for bucket in ctx.buckets:
            if bucket.index != DROPPED:
                allreduce(pack(bucket), op=ReduceOp.AVG, group=ctx.group)
                unpack(bucket)


class StaleLocalSGD(LocalSGD):
    """Averages the weights the replicas had at the previous average."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._old: list[torch.Tensor] | None = None

    def _average(self, ctx):
        current = [pack(b).clone() for b in ctx.buckets]
        for k, bucket in enumerate(ctx.buckets):
            if self._old is not None:
                bucket.flat.copy_(self._old[k])
            allreduce(bucket.flat, op=ReduceOp.AVG, group=ctx.group)
            unpack(bucket)
        self._old = current


class LateInitLowPrecision(LowPrecisionDecentralized):
    """The replicas start from the weights after the first local step (the old defect)."""

    def make_buckets(self, ctx):
        buckets = Algorithm.make_buckets(self, ctx)
        self._replicas = []
        return buckets

    def after_iteration(self, ctx):
        if not self._replicas:
            self._replicas = [{k: pack(b).clone() for k in REPLICAS} for b in ctx.buckets]
        super().after_iteration(ctx)


class NoReplicaUpdateLowPrecision(LowPrecisionDecentralized):
    """Sends and applies its own difference but never updates its neighbours' copies."""

    def _exchange(self, ctx):
        saved = [{k: rep[k].clone() for k in ("left", "right")} for rep in self._replicas]
        super()._exchange(ctx)
        for rep, old in zip(self._replicas, saved):
            rep.update(old)


class DropBucketLowPrecision(LowPrecisionDecentralized):
    """Gossips every bucket but one, which only takes its local steps."""

    def _exchange(self, ctx):
        buckets, replicas = ctx.buckets, self._replicas
        keep = [k for k in range(len(buckets)) if k != DROPPED]
        ctx.buckets = [buckets[k] for k in keep]
        self._replicas = [replicas[k] for k in keep]
        try:
            super()._exchange(ctx)
        finally:
            ctx.buckets, self._replicas = buckets, replicas


class SilentAsync(AsyncModelAverage):
    """Runs the background rounds but never applies their averages."""

    def _apply(self, delta):
        pass


class DropBucketAsync(AsyncModelAverage):
    """Applies the background average to every weight but the output layer's."""

    def _apply(self, delta):
        head = sum(p.numel() for p in self._weights[0].tensors[:2])  # last layer first
        delta = delta.clone()
        delta[:head] = 0
        super()._apply(delta)
