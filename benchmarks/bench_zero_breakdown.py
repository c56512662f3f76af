"""``bench_zero.py --breakdown``: where a step of each sharded strategy spends its time,
against its torch peer (run by bench_zero.py; not a program of its own).

Each contender steps ``--steps`` times after ``--warmup`` steps, contenders interleaved
step by step, with its phases timed on the caller's thread (``time.perf_counter``):
forward, backward (up to the end of ``backward()``: the wait for the last gradient
exchanges included), optimizer step. Inside them, commlib's own functions are timed by
wrappers installed for the run (exclusive time: a timed function's time minus the timed
functions it called), in categories:

==================  =============================================================
wait: gathers       FSDP ``_gather`` (waiting for an all-gather, pool bookkeeping);
                    ZeRO-1 ``_gather_parameters`` minus its copies
wait: grad exchange FSDP ``_end_backward`` (waiting for the reduce-scatters, adding
                    into ``shard.grad``); ZeRO-1 ``_reduce_gradients``
issue               FSDP ``_request`` (send-buffer clone/cast, submit), ZeRO-1
                    ``_launch`` minus copies (submit)
hooks               FSDP forward pre/post hooks, post-accumulate-grad hook, saved-tensor
                    pack/unpack; ZeRO-1's post-accumulate-grad hook
copies              ``Chunk.fill`` (received chunk into the gathered buffer), ZeRO-1
                    ``copy_in``/``copy_out`` (parameters <-> flat buffers)
optimizer           the wrapped optimizer's ``step`` (ZeRO-1: its local optimizer)
==================  =============================================================

``compute + rest`` is the phases' time not in any category (autograd's kernels, Python).
``MPI`` is commlib.stats' seconds of the step's collectives (on the communication
threads, overlapping the rest; torch peers: their gloo time is not visible and shows in
the phases). All figures: ms per step, the mean over the ranks.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import commlib

CATEGORIES = ("wait: gathers", "wait: grad exchange", "issue", "hooks", "copies",
              "optimizer")


class Profiler:
    """Exclusive time of wrapped functions by category, charged to :attr:`current` (a
    dict category -> seconds, or ``None``: not timing) and measured on the caller's thread
    only (the communication threads run commlib's collectives, counted as ``MPI``). The
    wrappers are installed before the contenders are built: hooks registered as bound
    methods at construction are the wrapped ones."""

    def __init__(self) -> None:
        self.current: dict[str, float] | None = None
        self._stack: list[list[float]] = []   # [start, time of timed children]
        self._main = threading.get_ident()

    def wrap(self, owner: Any, name: str, category: str) -> None:
        raw = owner.__dict__[name]
        static = isinstance(raw, staticmethod)
        original = raw.__func__ if static else raw
        prof = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            totals = prof.current
            if totals is None or threading.get_ident() != prof._main:
                return original(*args, **kwargs)
            prof._stack.append([time.perf_counter(), 0.0])
            try:
                return original(*args, **kwargs)
            finally:
                start, inner = prof._stack.pop()
                spent = time.perf_counter() - start
                totals[category] += spent - inner
                if prof._stack:
                    prof._stack[-1][1] += spent

        setattr(owner, name, staticmethod(timed) if static else timed)


def instrument(prof: Profiler) -> None:
    """Wrap commlib's sharded internals and ``torch.optim.Adam.step`` (class attributes:
    every instance built afterwards is timed)."""
    from commlib.sharded import chunks, flat_partition, stream, zero
    s = stream.ChunkSchedule
    for name, cat in (("_gather", "wait: gathers"), ("_end_backward", "wait: grad exchange"),
                      ("_request", "issue"), ("_pre_forward", "hooks"),
                      ("_post_forward", "hooks"), ("_on_grad", "hooks")):
        prof.wrap(s, name, cat)
    prof.wrap(chunks.Chunk, "fill", "copies")
    prof.wrap(stream, "pack", "hooks")
    prof.wrap(stream, "unpack", "hooks")
    z = zero.ZeroRedundancyOptimizer
    for name, cat in (("_gather_parameters", "wait: gathers"),
                      ("_reduce_gradients", "wait: grad exchange"), ("_launch", "issue"),
                      ("_on_grad", "hooks")):
        prof.wrap(z, name, cat)
    prof.wrap(flat_partition, "copy_in", "copies")
    prof.wrap(flat_partition, "copy_out", "copies")
    prof.wrap(torch.optim.Adam, "step", "optimizer")


def run(make_contenders: Callable[[], list], x: torch.Tensor, y: torch.Tensor, warmup: int,
        steps: int) -> dict[str, dict[str, float]]:
    """ms per step by phase and category for each contender (mean over the ranks)."""
    prof = Profiler()
    instrument(prof)
    contenders = make_contenders()
    for c in contenders:
        for _ in range(warmup):
            c.step(x, y)
    totals = {c.name: dict.fromkeys(CATEGORIES, 0.0) for c in contenders}
    phases = {c.name: dict.fromkeys(("forward", "backward", "step", "MPI"), 0.0)
              for c in contenders}
    for _ in range(steps):
        for c in contenders:
            commlib.barrier()
            before = commlib.stats()
            prof.current = totals[c.name]
            try:
                t0 = time.perf_counter()
                c.opt.zero_grad()
                loss = F.cross_entropy(c.module(x), y)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                c.opt.step()
                t3 = time.perf_counter()
            finally:
                prof.current = None
            after = commlib.stats()
            ph = phases[c.name]
            ph["forward"] += t1 - t0
            ph["backward"] += t2 - t1
            ph["step"] += t3 - t0
            ph["MPI"] += sum(v["seconds"] - before.get(op, {}).get("seconds", 0.0)
                             for op, v in after.items())
    out = {}
    for c in contenders:
        row = {**phases[c.name], **totals[c.name]}
        row["compute + rest"] = row["step"] - sum(totals[c.name].values())
        keys = sorted(row)
        mean = np.array([row[k] for k in keys]) * 1e3 / steps
        commlib.allreduce(mean, commlib.ReduceOp.AVG)
        out[c.name] = dict(zip(keys, mean.tolist()))
    return out


def table(results: dict[str, dict[str, float]]) -> str:
    cols = ["step", "forward", "backward", *CATEGORIES, "compute + rest", "MPI"]
    lines = ["| contender | " + " | ".join(cols) + " |",
             "|---|" + "---|" * len(cols)]
    for name, row in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[k]:.2f}" for k in cols) + " |")
    return "\n".join(lines)
