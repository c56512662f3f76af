"""Synchronous pipeline schedules as per-rank action lists (pure Python, no MPI).

A pipeline has ``S`` stages; micro-batch ``m`` of pipeline ``p`` runs forward ``F`` on
stages ``0..S-1`` and backward ``B`` on ``S-1..0``. A schedule places every stage of every
pipeline on a rank and orders, on each rank, its compute actions (``forward``,
``backward``) with the point-to-point actions they need (``recv`` just before, ``send``
just after), the ``allreduce`` of a replicated stage's gradients right after its last
backward (Chimera) and a final ``sync`` (wait for everything in flight).

The order comes from an ideal timeline in unit slots (every F and B takes one slot,
messages are free), built by list scheduling: at each slot every rank runs one ready action
by the schedule's priority, never holding more than the schedule's limit of forwarded but
not yet backwarded micro-batches per stage. This gives, for ``D`` ranks and ``M``
micro-batches:

* ``gpipe``: all forwards, then all backwards; bubble ``(D-1)/(M+D-1)``.
* ``1f1b``: backward first, at most ``D-s`` micro-batches in flight at stage ``s``
  (PipeDream-flush/DAPPLE); same bubble, activation memory ``D-s`` instead of ``M``.
* ``interleaved``: ``v`` chunks per rank (stage ``s`` on rank ``s % D``), Megatron-LM's
  order (groups of ``D`` micro-batches chunk by chunk, backward first); its published
  bubble ``(D-1)/(v*M+D-1)`` (in chunk slots) is a lower bound this list scheduling does
  not reach (e.g. 1/3 instead of 3/11 at D = M = 4, v = 2), below 1F1B's all the same.
* ``chimera``: two pipelines over the same ranks in opposite directions (stage ``s`` of
  pipeline 0 on rank ``s``, of pipeline 1 on rank ``D-1-s``; ``D`` even), each with half
  the micro-batches in 1F1B order; bubble ``(D-2)/(2M+D-2)`` (Li and Hoefler, SC'21,
  Table 2), and the two replicas of each stage all-reduce their gradients.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

SCHEDULES = ("gpipe", "1f1b", "interleaved", "chimera")
COMPUTE = ("forward", "backward")


@dataclass(frozen=True)
class Action:
    """One step of a rank. ``forward``/``backward``: compute ``(pipe, stage, micro)`` in
    ideal-timeline ``slot``. ``send``/``recv``: the ``tensor`` (``"activation"`` or
    ``"grad"``) that ``stage`` produced for micro-batch ``micro`` of ``pipe``, to/from rank
    ``peer``. ``allreduce``: the gradients of ``stage`` over its replicas. ``sync``: wait
    for every operation in flight."""
    kind: str
    pipe: int = 0
    stage: int = -1
    micro: int = -1
    peer: int = -1
    tensor: str = ""
    slot: int = -1


@dataclass
class Schedule:
    """``actions[r]``: rank ``r``'s ordered actions. ``placement[(pipe, stage)]``: the rank
    running that stage; ``micros[pipe]``: the micro-batches (global indices) of ``pipe``."""
    name: str
    ranks: int
    stages: int
    micro_batches: int
    placement: dict
    micros: tuple
    actions: list = field(default_factory=list)

    @property
    def pipes(self) -> int:
        return len(self.micros)

    def rank_of(self, pipe: int, stage: int) -> int:
        return self.placement[(pipe, stage)]

    def stages_of(self, rank: int) -> list[tuple[int, int]]:
        """The (pipe, stage) pairs that run on ``rank``."""
        return sorted(k for k, r in self.placement.items() if r == rank)

    def replicas(self, stage: int) -> list[int]:
        """Ranks holding a copy of ``stage`` (one per pipeline), ascending."""
        return sorted({self.placement[(p, stage)] for p in range(self.pipes)})

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.kind in COMPUTE]

    @property
    def makespan(self) -> int:
        """Slots of the ideal timeline."""
        return 1 + max(a.slot for r in range(self.ranks) for a in self.compute(r))

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the ideal timeline: 1 - busy slots / (ranks x makespan)."""
        busy = sum(len(self.compute(r)) for r in range(self.ranks))
        return 1.0 - busy / (self.ranks * self.makespan)


def bubble_formula(name: str, ranks: int, micro_batches: int, chunks: int = 2) -> float:
    """The published bubble fraction of a schedule (forward and backward of equal cost)."""
    d, m = ranks, micro_batches
    if name in ("gpipe", "1f1b"):
        return (d - 1) / (m + d - 1)
    if name == "interleaved":
        return (d - 1) / (chunks * m + d - 1)
    if name == "chimera":
        return (d - 2) / (2 * m + d - 2)
    raise ValueError(f"unknown schedule {name!r}; expected one of {SCHEDULES}")


def generate(name: str, ranks: int, micro_batches: int, chunks: int = 2) -> Schedule:
    """The schedule ``name`` for ``ranks`` ranks and ``micro_batches`` micro-batches
    (``chunks`` stages per rank under ``interleaved``). Raises ValueError on shapes the
    schedule does not allow."""
    d, m = ranks, micro_batches
    for arg, value in (("ranks", d), ("micro_batches", m), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"commlib.pipeline: argument {arg!r}={value!r} must be a "
                             f"positive int")
    if name == "chimera":
        if d % 2:
            raise ValueError(f"commlib.pipeline: schedule 'chimera' needs an even number of "
                             f"ranks, got {d}")
        if m < 2:
            raise ValueError(f"commlib.pipeline: schedule 'chimera' needs micro_batches >= 2 "
                             f"(one per direction), got {m}")
        half = (m + 1) // 2
        micros = (tuple(range(half)), tuple(range(half, m)))
        placement = {(p, s): (s if p == 0 else d - 1 - s) for p in (0, 1) for s in range(d)}
        stages = d
    elif name in ("gpipe", "1f1b", "interleaved"):
        v = chunks if name == "interleaved" else 1
        stages = d * v
        micros = (tuple(range(m)),)
        placement = {(0, s): s % d for s in range(stages)}
    else:
        raise ValueError(f"commlib.pipeline: argument 'schedule'={name!r} must be one of "
                         f"{SCHEDULES}")
    sched = Schedule(name, d, stages, m, placement, micros)
    # limit(p, s): the micro-batches stage s of pipeline p may hold at once; prio(kind, p,
    # i, s): the order of the ready actions (the smallest first)
    if name == "gpipe":
        def limit(p: int, s: int) -> int:
            return m

        def prio(k: str, p: int, i: int, s: int) -> tuple:
            return (k == "backward", i, p)  # forwards first
    elif name == "interleaved":
        # Megatron-LM's order: groups of D micro-batches, chunk by chunk
        def limit(p: int, s: int) -> int:
            return m

        def prio(k: str, p: int, i: int, s: int) -> tuple:
            return (k == "forward", i // d,
                    s // d if k == "forward" else chunks - 1 - s // d, i % d)
    else:
        def limit(p: int, s: int) -> int:
            return stages - s  # 1F1B per pipeline

        def prio(k: str, p: int, i: int, s: int) -> tuple:
            return (k == "forward", i, p)  # backward first
    timeline = _timeline(sched, prio, limit)
    sched.actions = [_with_messages(sched, r, timeline[r]) for r in range(d)]
    return sched


def _timeline(sched: Schedule, prio: Callable, limit: Callable) -> list[list[Action]]:
    """List scheduling in unit slots (see the module docstring)."""
    d, n = sched.ranks, sched.stages
    todo = {r: [] for r in range(d)}
    for p, ms in enumerate(sched.micros):
        for i, m in enumerate(ms):
            for s in range(n):
                for kind in COMPUTE:
                    todo[sched.rank_of(p, s)].append((kind, p, m, s, i))
    done: dict = {}
    in_flight: Counter = Counter()
    out: list[list[Action]] = [[] for _ in range(d)]
    slot, left = 0, sum(len(t) for t in todo.values())
    while left:
        picked = {}
        for r in range(d):
            ready = []
            for kind, p, m, s, i in todo[r]:
                if kind == "forward":
                    ok = (s == 0 or done.get(("forward", p, m, s - 1), slot) < slot) \
                        and in_flight[(p, s)] < limit(p, s)
                else:
                    ok = done.get(("forward", p, m, s), slot) < slot and \
                        (s == n - 1 or done.get(("backward", p, m, s + 1), slot) < slot)
                if ok:
                    ready.append((prio(kind, p, i, s), (kind, p, m, s, i)))
            if ready:
                picked[r] = min(ready)[1]
        if not picked:
            raise RuntimeError(f"commlib.pipeline: schedule {sched.name!r} is stuck at slot "
                               f"{slot}")  # pragma: no cover - the limits above never stall
        for r, task in picked.items():
            kind, p, m, s, _ = task
            todo[r].remove(task)
            done[(kind, p, m, s)] = slot
            in_flight[(p, s)] += 1 if kind == "forward" else -1
            out[r].append(Action(kind, p, s, m, slot=slot))
        slot += 1
        left -= len(picked)
    return out


def _with_messages(sched: Schedule, rank: int, compute: list[Action]) -> list[Action]:
    """Add the recv before and the send after each compute action, each stage's allreduce
    after its last backward (when it has replicas) and the final sync."""
    n = sched.stages
    last_b = {}
    for i, a in enumerate(compute):
        if a.kind == "backward":
            last_b[a.stage] = i
    out = []
    for i, a in enumerate(compute):
        p, s, m = a.pipe, a.stage, a.micro
        if a.kind == "forward":
            if s > 0:
                out.append(Action("recv", p, s - 1, m, sched.rank_of(p, s - 1), "activation"))
            out.append(a)
            if s < n - 1:
                out.append(Action("send", p, s, m, sched.rank_of(p, s + 1), "activation"))
        else:
            if s < n - 1:
                out.append(Action("recv", p, s + 1, m, sched.rank_of(p, s + 1), "grad"))
            out.append(a)
            if s > 0:
                out.append(Action("send", p, s, m, sched.rank_of(p, s - 1), "grad"))
            if last_b[s] == i and len(sched.replicas(s)) > 1:
                out.append(Action("allreduce", stage=s))
    out.append(Action("sync"))
    return out


def validate(sched: Schedule) -> None:
    """Raise ValueError unless ``sched`` is a correct synchronous schedule: every forward
    and backward of every (pipeline, micro-batch, stage) exactly once on its rank; no rank
    with two compute actions in one slot; the timeline respects the dependencies; and the
    action lists run to the end (every recv matched by a send, every send received, every
    replicated stage all-reduced by all its replicas, no deadlock)."""
    want = Counter((k, p, m, s) for p, ms in enumerate(sched.micros) for m in ms
                   for s in range(sched.stages) for k in COMPUTE)
    got, where, slot_of = Counter(), {}, {}
    for r in range(sched.ranks):
        slots = [a.slot for a in sched.compute(r)]
        if len(set(slots)) != len(slots):
            raise ValueError(f"schedule {sched.name!r}: rank {r} has two actions in one slot")
        if slots != sorted(slots):
            raise ValueError(f"schedule {sched.name!r}: rank {r} runs its actions out of "
                             f"slot order")
        for a in sched.compute(r):
            key = (a.kind, a.pipe, a.micro, a.stage)
            got[key] += 1
            where[key] = r
            slot_of[key] = a.slot
    if got != want:
        missing = sorted((want - got).elements())
        extra = sorted((got - want).elements())
        raise ValueError(f"schedule {sched.name!r}: compute actions missing {missing[:4]} "
                         f"or repeated/unknown {extra[:4]}")
    for (k, p, m, s), r in where.items():
        if r != sched.rank_of(p, s):
            raise ValueError(f"schedule {sched.name!r}: {k} of stage {s} on rank {r}, "
                             f"placed on rank {sched.rank_of(p, s)}")
        before = []
        if k == "forward" and s > 0:
            before = [("forward", p, m, s - 1)]
        if k == "backward":
            before = [("forward", p, m, s)]
            if s < sched.stages - 1:
                before.append(("backward", p, m, s + 1))
        for dep in before:
            if slot_of[dep] >= slot_of[(k, p, m, s)]:
                raise ValueError(f"schedule {sched.name!r}: {k} of (pipe {p}, micro {m}, "
                                 f"stage {s}) in slot {slot_of[(k, p, m, s)]} before its "
                                 f"dependency {dep} in slot {slot_of[dep]}")
    _replay(sched)


def _replay(sched: Schedule) -> None:
    """Run the action lists with blocking recvs, non-blocking sends and pairwise
    allreduces; raise ValueError on a deadlock or an unmatched message."""
    d = sched.ranks
    pos = [0] * d
    mailbox: Counter = Counter()
    have: list[set] = [set() for _ in range(d)]
    reduced: dict = {}
    progress = True
    while progress:
        progress = False
        for r in range(d):
            while pos[r] < len(sched.actions[r]):
                a = sched.actions[r][pos[r]]
                if a.kind == "send":
                    made = ("forward" if a.tensor == "activation" else "backward",
                            a.pipe, a.micro, a.stage)
                    if made not in have[r]:
                        raise ValueError(f"schedule {sched.name!r}: rank {r} sends the "
                                         f"{a.tensor} of {made[1:]} before computing it")
                    mailbox[(r, a.peer, a.pipe, a.stage, a.micro, a.tensor)] += 1
                elif a.kind == "recv":
                    key = (a.peer, r, a.pipe, a.stage, a.micro, a.tensor)
                    if not mailbox[key]:
                        break
                    mailbox[key] -= 1
                    have[r].add(("in", a.tensor, a.pipe, a.micro, a.stage))
                elif a.kind in COMPUTE:
                    p, s, m = a.pipe, a.stage, a.micro
                    if a.kind == "forward":
                        need = [] if s == 0 else [("in", "activation", p, m, s - 1)]
                    else:
                        need = [("forward", p, m, s)]
                        if s < sched.stages - 1:
                            need.append(("in", "grad", p, m, s + 1))
                    if any(x not in have[r] for x in need):
                        raise ValueError(f"schedule {sched.name!r}: rank {r} runs {a.kind} "
                                         f"of (pipe {p}, micro {m}, stage {s}) without its "
                                         f"inputs")
                    have[r].add((a.kind, p, m, s))
                elif a.kind == "allreduce":
                    reduced.setdefault(a.stage, set()).add(r)  # started; done by sync
                elif a.kind != "sync":
                    raise ValueError(f"schedule {sched.name!r}: unknown action {a.kind!r}")
                pos[r] += 1
                progress = True
    stuck = [r for r in range(d) if pos[r] < len(sched.actions[r])]
    if stuck:
        r = stuck[0]
        raise ValueError(f"schedule {sched.name!r}: deadlock; rank {r} waits at "
                         f"{sched.actions[r][pos[r]]} (ranks {stuck} stuck)")
    left = [k for k, v in mailbox.items() if v]
    if left:
        raise ValueError(f"schedule {sched.name!r}: messages sent but never received: "
                         f"{left[:4]}")
    for s in range(sched.stages):
        replicas = set(sched.replicas(s))
        if len(replicas) > 1 and reduced.get(s, set()) != replicas:
            raise ValueError(f"schedule {sched.name!r}: stage {s} all-reduced by ranks "
                             f"{sorted(reduced.get(s, ()))}, replicas are {sorted(replicas)}")
