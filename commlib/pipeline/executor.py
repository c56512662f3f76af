"""Run a pipeline schedule over commlib's non-blocking send/recv."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import primitives
from ..base.errors import where
from ..base.reduce_ops import ReduceOp
from .schedule import SCHEDULES, Action, generate

_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128)
_META = 10  # ndim, dtype code, up to 8 dims


class Pipeline(torch.nn.Module):
    """Synchronous pipeline-parallel training of ``stages`` over the ranks of ``group``.

    Collective over ``group`` (default: the world) of ``D`` ranks: every rank passes the
    same list of stage modules (``D`` stages; ``chunks * D`` under ``"interleaved"``) and
    keeps those the schedule places on it (stage ``s`` on rank ``s``; under ``"chimera"``
    also stage ``D-1-s`` of the second, opposite pipeline; under ``"interleaved"`` the
    stages ``s = rank (mod D)``). Each stage's initial parameters and buffers are broadcast
    from the rank running it in the first pipeline (the other ranks' copies are
    overwritten). A stage takes and returns one tensor; ``loss_fn(output, target)`` is the
    loss of one micro-batch.

    :meth:`train_step` splits the batch into ``micro_batches`` micro-batches along dim 0
    (``torch.tensor_split``), runs their forwards and backwards by the schedule and adds to
    ``.grad`` of :meth:`parameters` (this rank's stages) the gradient of the mean of the
    micro-batch losses: Chimera's two replicas of a stage all-reduce their gradients (the
    exchange starts right after the stage's last backward) and hold bit-identical
    gradients; with ``dp_group`` the gradients are then averaged over it (pipeline replicas
    along a data-parallel axis, e.g. ``Topology(dp=2, pp=2).group("dp")``).
    These exchanges cover the parameters that require grad, one flat buffer per dtype
    (a stage may mix dtypes), each with one presence flag per parameter: a parameter
    gets the reduced gradient where at least one rank of the exchange produced one
    (zeros stand in for the others, as torch DDP's ``find_unused_parameters=True`` does)
    and keeps ``.grad`` None where none did; frozen parameters (``requires_grad=False``)
    are never touched, so an optimizer's weight decay skips them as in one process. The
    ranks of an exchange must agree on which parameters require grad (same modules).
    Buffers (e.g. BatchNorm statistics) are not exchanged: under Chimera each replica of
    a stage updates its own from its half of the micro-batches.
    A stage may be a :class:`commlib.DistributedDataParallel` (any object with its
    ``prepare_for_backward(outputs, sync)``) over a data-parallel group, instead of
    ``dp_group``: its gradients are then exchanged by its algorithm during the stage's
    last backward of the step on this rank (overlapping the rest of the schedule); the
    earlier backwards only accumulate.
    Activation shapes are agreed by one metadata message per activation on the first step
    for each input shape, then every receive is posted when the step starts.

    ``last_step``: ``{"seconds", "waiting"}`` of the last :meth:`train_step` on this rank
    (its schedule's part, and the time spent waiting for messages within it).

    ``poll_s``: waits test and sleep this long between tests instead of spinning in MPI
    (default: the job's choice, option ``wait_poll_us``: 50 us when some host runs more
    ranks than it has cores, else 0: MPI's wait).

    :meth:`close` (or leaving a ``with Pipeline(...) as pipe:`` block) frees the
    communicators of the replicated stages; call it on every rank when done.
    """

    def __init__(self, stages: Sequence[torch.nn.Module], group: Any = None,
                 schedule: str = "1f1b", micro_batches: int = 4,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 chunks: int = 2, dp_group: Any = None, broadcast_weights: bool = True,
                 poll_s: float | None = None) -> None:
        super().__init__()
        from ..core.runtime import init
        init()
        self.group = group if group is not None else primitives.world()
        rank = self.group.rank
        if rank < 0:
            raise ValueError(f"{where('Pipeline', rank)}: this rank is not a member of "
                             f"argument 'group'")
        if schedule not in SCHEDULES:
            raise ValueError(f"{where('Pipeline', rank)}: argument 'schedule'={schedule!r} "
                             f"must be one of {SCHEDULES}")
        if loss_fn is None or not callable(loss_fn):
            raise TypeError(f"{where('Pipeline', rank)}: argument 'loss_fn' must be a "
                            f"callable (output, target) -> scalar loss")
        stages = list(stages)
        if not all(isinstance(s, torch.nn.Module) for s in stages):
            raise TypeError(f"{where('Pipeline', rank)}: argument 'stages' must be a list "
                            f"of torch.nn.Module")
        owner: dict = {}
        for s, module in enumerate(stages):
            for name, p in module.named_parameters():
                first = owner.setdefault(id(p), (s, name))
                if first[0] != s:
                    raise ValueError(
                        f"{where('Pipeline', rank)}: argument 'stages': parameter {name!r} "
                        f"of stage {s} is also parameter {first[1]!r} of stage {first[0]}; "
                        f"stages must not share parameters (a tie between stages on "
                        f"different ranks would silently break: each would train its own "
                        f"copy)")
        self.schedule = generate(schedule, self.group.size, micro_batches, chunks)
        if len(stages) != self.schedule.stages:
            raise ValueError(f"{where('Pipeline', rank)}: argument 'stages' has "
                             f"{len(stages)} modules; schedule {schedule!r} over "
                             f"{self.group.size} ranks needs {self.schedule.stages}")
        self.rank = rank
        self.micro_batches = micro_batches
        self.loss_fn = loss_fn
        self.dp_group = dp_group
        self.actions: list[Action] = self.schedule.actions[rank]
        self._all = stages
        self.local_ids = sorted({s for _, s in self.schedule.stages_of(rank)})
        self.local_stages = torch.nn.ModuleList([stages[s] for s in self.local_ids])
        # each stage's last backward on this rank: where a stage that exchanges its own
        # gradients (a DistributedDataParallel wrapper) exchanges them
        self._last_backward = {a.stage: (a.pipe, a.micro) for a in self.actions
                               if a.kind == "backward"}
        if broadcast_weights:
            for s, module in enumerate(stages):
                src = self.schedule.rank_of(0, s)
                for t in list(module.parameters()) + list(module.buffers()):
                    self.group.broadcast(t.data, src=src)
        # one group per replicated stage (an allreduce each per step, so their order on the
        # two replicas does not matter)
        self._replica_groups = {}
        for s in self.local_ids:
            replicas = self.schedule.replicas(s)
            if len(replicas) > 1:
                world_ranks = [self.group.ranks[r] for r in replicas]
                self._replica_groups[s] = primitives.group_from_ranks(world_ranks)
        if poll_s is None:   # the job's choice (option wait_poll_us)
            poll_s = getattr(getattr(self.group, "comm", None), "poll_s", 0.0)
        self.poll_s = float(poll_s)
        self._shapes: dict = {}
        self._meta_base = 2 * self.schedule.stages * self.schedule.pipes * micro_batches
        self._closed = False

    def close(self) -> None:
        """Release the communicators of the replicated stages' groups (idempotent; call it
        on every rank of ``group``, once no step is running). :meth:`train_step` and
        :meth:`eval_step` raise afterwards; the stage modules stay usable."""
        if self._closed:
            return
        self._closed = True
        groups, self._replica_groups = self._replica_groups, {}
        for g in groups.values():
            g.free()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise RuntimeError(f"{where('Pipeline.' + op, self.rank)}: the pipeline is "
                               f"closed")

    # -- tags ------------------------------------------------------------------------------
    def _tag(self, a: Action) -> int:
        sched = self.schedule
        kind = 1 if a.tensor == "grad" else 0
        return ((a.stage * sched.pipes + a.pipe) * 2 + kind) * self.micro_batches + a.micro

    # -- training --------------------------------------------------------------------------
    def train_step(self, inputs: torch.Tensor, targets: Any) -> float:
        """One global batch: forward and backward of every micro-batch by the schedule.

        ``inputs`` (batch first) and ``targets`` (batch first, or anything
        ``torch.tensor_split`` splits) must be the same on every rank (only the ranks of
        the first and last stages use them). Gradients are added to ``.grad`` of
        :meth:`parameters`; returns the mean micro-batch loss (a float, the same on every
        rank)."""
        self._check_open("train_step")
        m_count = self.micro_batches
        xs = self._split(inputs, "inputs")
        ts = self._split(targets, "targets")
        replicated = [s for s in self.local_ids if s in self._replica_groups]
        saved = {}
        if replicated or self.dp_group is not None:
            # the exchanges reduce this step's gradients only
            for p in self.parameters():
                if p.requires_grad:
                    saved[p] = p.grad
                    p.grad = None
        key = (tuple(inputs.shape), inputs.dtype)
        shapes = self._shapes.get(key)
        discover = shapes is None
        if discover:
            shapes = {}
        inbox: dict = {}
        pending: dict = {}
        if not discover:
            for a in self.actions:
                if a.kind == "recv":
                    k = (a.pipe, a.stage, a.micro, a.tensor)
                    shape, dtype = shapes[k]
                    buf = torch.empty(shape, dtype=dtype)
                    pending[k] = (self.group.recv(buf, a.peer, self._tag(a), async_op=True),
                                  buf)
        ctx: dict = {}
        sends: list = []
        reductions: list = []
        loss_sum = torch.zeros(1, dtype=torch.float64)
        last = self.schedule.stages - 1
        waited, started = 0.0, time.perf_counter()
        for a in self.actions:
            k = (a.pipe, a.stage, a.micro, a.tensor)
            if a.kind == "recv":
                if discover:
                    if a.tensor == "activation":
                        meta = torch.zeros(_META, dtype=torch.int64)
                        self.group.recv(meta, a.peer, self._meta_base + self._tag(a))
                        n = int(meta[0])
                        shape, dtype = tuple(int(v) for v in meta[2:2 + n]), _DTYPES[int(meta[1])]
                    else:  # the gradient of this rank's output
                        out = ctx[(a.pipe, a.stage - 1, a.micro)][1]
                        shape, dtype = tuple(out.shape), out.dtype
                    shapes[k] = (shape, dtype)
                    buf = torch.empty(shape, dtype=dtype)
                    self.group.recv(buf, a.peer, self._tag(a))
                    inbox[k] = buf
                else:
                    work, buf = pending.pop(k)
                    t0 = time.perf_counter()
                    work.wait(self.poll_s)
                    waited += time.perf_counter() - t0
                    inbox[k] = buf
            elif a.kind == "forward":
                p, s, m = a.pipe, a.stage, a.micro
                if s == 0:
                    x = xs[m]
                else:
                    x = inbox.pop((p, s - 1, m, "activation"))
                    if x.is_floating_point() or x.is_complex():
                        x.requires_grad_(True)
                with torch.enable_grad():
                    y = self._all[s](x)
                    if s == last:
                        loss = self.loss_fn(y, ts[m])
                        loss_sum += loss.detach().to(torch.float64).reshape(1)
                        y = loss / m_count
                ctx[(p, s, m)] = (x, y)
            elif a.kind == "backward":
                p, s, m = a.pipe, a.stage, a.micro
                x, y = ctx.pop((p, s, m))
                grad = None if s == last else inbox.pop((p, s + 1, m, "grad"))
                prepare = getattr(self._all[s], "prepare_for_backward", None)
                if prepare is not None and y.requires_grad:
                    prepare(y, sync=self._last_backward[s] == (p, m))
                if y.requires_grad:
                    torch.autograd.backward(y, grad)
                if s > 0:
                    g = x.grad if x.grad is not None else torch.zeros_like(x)
                    x.grad = None
                    ctx[("grad", p, s, m)] = g.contiguous()
            elif a.kind == "send":
                if a.tensor == "activation":
                    t = ctx[(a.pipe, a.stage, a.micro)][1].detach().contiguous()
                    if discover:
                        meta = self._meta(t)
                        sends.append((self.group.send(meta, a.peer,
                                                      self._meta_base + self._tag(a),
                                                      async_op=True), meta))
                else:
                    t = ctx.pop(("grad", a.pipe, a.stage, a.micro))
                sends.append((self.group.send(t, a.peer, self._tag(a), async_op=True), t))
            elif a.kind == "allreduce":
                for flat, params in _pack(_trainable(self._all[a.stage])):
                    work = self._replica_groups[a.stage].allreduce(flat, async_op=True)
                    reductions.append((work, flat, params))
            elif a.kind == "sync":
                t0 = time.perf_counter()
                for work, _ in sends:
                    work.wait(self.poll_s)
                for work, flat, params in reductions:
                    work.wait(self.poll_s)
                    _unpack(flat, params)
                waited += time.perf_counter() - t0
        self.last_step = {"seconds": time.perf_counter() - started, "waiting": waited}
        if discover:
            self._shapes[key] = shapes
        if self.dp_group is not None:
            for flat, params in _pack(_trainable(self)):
                self.dp_group.allreduce(flat, op=ReduceOp.AVG)
                _unpack(flat, params)
        for p, g in saved.items():
            if g is not None:
                p.grad = g + p.grad if p.grad is not None else g
        self.group.allreduce(loss_sum)
        return float(loss_sum[0]) / m_count

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor) -> torch.Tensor:
        """Forward ``inputs`` (batch first, the same on every rank) through the first
        pipeline, micro-batch by micro-batch; returns the output (the concatenated outputs
        of the last stage) on every rank. Parameters and gradients are untouched."""
        self._check_open("eval_step")
        xs = self._split(inputs, "inputs")
        sched, group = self.schedule, self.group
        last = sched.stages - 1
        base = 2 * self._meta_base
        outputs, sends = [], []
        for m, x in enumerate(xs):
            for s in range(sched.stages):
                if sched.rank_of(0, s) != self.rank:
                    continue
                if s > 0:
                    src = sched.rank_of(0, s - 1)
                    x = self._recv_tensor(src, base + 2 * (m * sched.stages + s))
                y = self._all[s](x)
                if s < last:
                    sends += self._send_tensor(y, sched.rank_of(0, s + 1),
                                               base + 2 * (m * sched.stages + s + 1))
                else:
                    outputs.append(y)
                x = y
        for work, _ in sends:
            work.wait(self.poll_s)
        owner = sched.rank_of(0, last)
        out = torch.cat(outputs) if self.rank == owner else None
        meta = self._meta(out) if out is not None else torch.zeros(_META, dtype=torch.int64)
        group.broadcast(meta, src=owner)
        if out is None:
            n = int(meta[0])
            out = torch.empty(tuple(int(v) for v in meta[2:2 + n]),
                              dtype=_DTYPES[int(meta[1])])
        group.broadcast(out, src=owner)
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("commlib.pipeline.Pipeline: call train_step(inputs, targets) or "
                           "eval_step(inputs)")

    # -- helpers ---------------------------------------------------------------------------
    def _split(self, batch: Any, name: str) -> list:
        if not isinstance(batch, torch.Tensor):
            raise TypeError(f"{where('Pipeline', self.rank)}: argument {name!r} must be a "
                            f"torch.Tensor, got {type(batch).__name__}")
        if batch.dim() == 0 or batch.shape[0] < self.micro_batches:
            raise ValueError(f"{where('Pipeline', self.rank)}: argument {name!r} of shape "
                             f"{tuple(batch.shape)} must have at least micro_batches="
                             f"{self.micro_batches} rows")
        return list(torch.tensor_split(batch, self.micro_batches))

    @staticmethod
    def _meta(t: torch.Tensor) -> torch.Tensor:
        if t.dim() > _META - 2 or t.dtype not in _DTYPES:
            raise ValueError(f"commlib.pipeline: cannot send a {t.dtype} activation of "
                             f"{t.dim()} dims between stages")
        return torch.tensor([t.dim(), _DTYPES.index(t.dtype), *t.shape]
                            + [0] * (_META - 2 - t.dim()), dtype=torch.int64)

    def _send_tensor(self, t: torch.Tensor, dst: int, tag: int) -> list:
        """Non-blocking (a rank may send to itself): returns the (work, buffer) pairs."""
        t, meta = t.contiguous(), self._meta(t)
        return [(self.group.send(meta, dst, tag, async_op=True), meta),
                (self.group.send(t, dst, tag + 1, async_op=True), t)]

    def _recv_tensor(self, src: int, tag: int) -> torch.Tensor:
        meta = torch.zeros(_META, dtype=torch.int64)
        self.group.recv(meta, src, tag)
        n = int(meta[0])
        out = torch.empty(tuple(int(v) for v in meta[2:2 + n]), dtype=_DTYPES[int(meta[1])])
        self.group.recv(out, src, tag + 1)
        return out


def _trainable(module: torch.nn.Module) -> list:
    """The parameters of ``module`` whose gradients are exchanged: those that require grad
    (frozen ones are never touched, so they keep ``.grad`` as it was: usually None)."""
    return [p for p in module.parameters() if p.requires_grad]


def _pack(params: list) -> list:
    """One flat buffer per (dtype, device) of ``params``, in order of first appearance (the
    same on every rank holding the same modules): the gradients (zeros where ``.grad`` is
    None; sparse ones densified), then one presence flag per parameter (1 where this rank
    has a gradient). Summed or averaged over a group, a flag is non-zero exactly where some
    rank had a gradient. Returns ``[(flat, params of that buffer)]``."""
    buckets: dict = {}
    for p in params:
        buckets.setdefault((p.dtype, p.device), []).append(p)
    out = []
    for (dtype, device), ps in buckets.items():
        parts = []
        for p in ps:
            g = p.grad
            if g is None:
                g = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif g.is_sparse:
                g = g.to_dense()
            parts.append(g.reshape(-1))
        parts.append(torch.tensor([p.grad is not None for p in ps], dtype=dtype,
                                  device=device))
        out.append((torch.cat(parts), ps))
    return out


def _unpack(flat: torch.Tensor, params: list) -> None:
    """Set ``.grad`` of ``params`` from a reduced :func:`_pack` buffer: the reduced
    gradient where some rank had one, None where no rank did (as DDP with
    ``find_unused_parameters=True`` leaves a parameter no rank used)."""
    flags = flat[flat.numel() - len(params):].tolist()
    offset = 0
    for p, present in zip(params, flags):
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone() if present != 0 else None
        offset += n
