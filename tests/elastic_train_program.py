"""Elastic training under failures, and its reference; driven by test_elastic.py and
benchmarks/bench_faults.py.

Usage::

    python elastic_train_program.py OUTDIR [--algorithm A] [--steps N] [--fault F]
        [--victims R1[,R2]] [--at K1[,K2]] [--skip-agreement] [--reference C1[,C2]]
        [--width W] [--no-ft] [--scale-lr] [--min-ranks M] [--scenarios JSON]

A float64 MLP trained with SGD with momentum through ``commlib.elastic`` (``State``,
``run``, ``ElasticSampler``: the global batch of 24 samples of each step is split over the
ranks alive). Fault ``F`` on victim ``R_i`` at step ``K_i``:

``kill``     SIGKILL in the middle of the step's backward (some gradient buckets on their
             way, others not yet)
``exit``     ``os._exit(7)`` at the same point
``killfwd``  SIGKILL in the middle of the step's forward (a forward hook of the second
             linear layer: the first layer computed, nothing of the step exchanged)
``killcommit`` SIGKILL in the middle of ``State.commit`` of step ``K`` (the optimizer step
             applied and counted, the commit not recorded; the others commit and meet
             the death in the next step's exchange)
``sysexit``  an ordinary ``sys.exit(0)`` between steps
``lag``      the victim is killed right after its step's exchange; survivor rank 1 then
             behaves as if its own exchange had failed (raises ``PeerFailure`` before its
             optimizer step) while the others apply the step: the survivors are one step
             apart, which only the step agreement can repair (the other faults produce it
             by chance)
``lagavg``   (``local_sgd``, ``K`` a multiple of ``sync_every``) the victim is killed right
             after the average of step ``K``; survivor rank 1 takes part in that average but
             then behaves as if its wait had been given up on (raises ``PeerFailure`` before
             applying it): rank 1 is one average behind the others, with its own optimizer
             state of step ``K`` (local_sgd never averages it)
``idlekill`` (with ``--spares``) a victim that is a spare SIGKILLs itself while standing
             by, once rank 0 has committed step ``K``; a victim that trains as ``kill``
``none``     no fault

``--reference C1[,C2]``: no fault tolerance, no failure: the same training, with the
victims leaving voluntarily after the committed steps ``C_i`` and the others going on
over a group of the remaining ranks (made with ``new_group``), rewrapped as ``run`` does
(and the learning rate scaled as ``run`` scales it with ``--scale-lr``): the run the
survivors must match exactly. ``--scenarios JSON``: several such references in one job
(a list of ``{"name", "algorithm", "victims", "steps", "scale_lr"}``; no victims: the run
without failure), one after the other from the initial model, each written to
``OUTDIR/<name>/`` (one job instead of one per reference: most of a job is startup).
``--scale-lr``, ``--min-ranks M``: ``State(scale_lr=True)``, ``run(min_ranks=M)``.
``--pause S``: every rank sleeps ``S`` seconds after each step (successive deaths that
are apart in time as well as in steps; the results do not change).
``--forget-own-state``: after a recovery the algorithm's per-rank state (the error
feedback of ``sparseloco``, ``muloco``, ``demo``) restarts from zero instead of the
restored commit's (the negative control of test_elastic.py).
``--spares K``: ``run(spares=K)`` (the last ``K`` ranks stand by; a spare that joined
writes ``rank{r}.json`` like the others, one released at the end ``spare{r}.json``: its
step, the pool it knew, the CPU and wall seconds it spent in ``run``);
``--skip-spare-state``: a joining spare keeps its own model (the negative control of
tests/test_elastic_spares.py). ``--join-victim R --join-death P``: spare ``R`` SIGKILLs
itself at point ``P`` of its joining (``called``, ``assembled``, ``receiving``,
``received``: ``commlib.elastic.spares._JOIN_HOOK``).

Every rank writes ``OUTDIR/shm{r}.json`` (its MPICH segments); every rank that finishes
writes ``OUTDIR/rank{r}.json``: final step, the state's ledger (the group size that applied
each step), its recoveries (agreed values, seconds), the parameters (float64 bytes, hex) and
timestamps of the fault (written by the victim as ``fault{r}.json``) and of every step.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("outdir")
parser.add_argument("--algorithm", default="gradient_allreduce")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--fault", default="none")
parser.add_argument("--victims", default="3")
parser.add_argument("--at", default="12")
parser.add_argument("--skip-agreement", action="store_true")
parser.add_argument("--reference", default="")
parser.add_argument("--width", type=int, default=32)
parser.add_argument("--pause", type=float, default=0.0,
                    help="seconds every rank sleeps after each step (not in references)")
parser.add_argument("--no-ft", action="store_true")
parser.add_argument("--bucket-mb", type=float, default=0.005)
parser.add_argument("--replace", action="store_true",
                    help="spawn a replacement for each dead rank, on its host")
parser.add_argument("--scale-lr", action="store_true", help="State(scale_lr=True)")
parser.add_argument("--min-ranks", type=int, default=1, help="run(min_ranks=...)")
parser.add_argument("--forget-own-state", action="store_true",
                    help="after a recovery, reset the algorithm's per-rank state (error "
                         "feedback) instead of restoring it (negative control)")
parser.add_argument("--scenarios", default="",
                    help="JSON list of references to train one after the other")
parser.add_argument("--spares", type=int, default=0,
                    help="run(spares=K): the last K ranks stand by")
parser.add_argument("--refill", action="store_true",
                    help="run(refill=True): spawn new spares once spares joined")
parser.add_argument("--skip-spare-state", action="store_true",
                    help="a joining spare keeps its own model (negative control)")
parser.add_argument("--join-victim", type=int, default=-1,
                    help="this spare SIGKILLs itself at --join-death while it joins")
parser.add_argument("--replacement-dies-at", type=int, default=0,
                    help="the first replacement spawned by --replace SIGKILLs itself in "
                         "the middle of the backward of this step")
parser.add_argument("--replacement-join-death", default="",
                    help="the first replacement spawned by --replace SIGKILLs itself at "
                         "this point of its joining: assembled (the grown world built), "
                         "received (the state taken)")
parser.add_argument("--other-machines", action="store_true",
                    help="after init each process reports a boot id of its own: the "
                         "processes of a grown world look as if on other machines to "
                         "each other (watched by connection, commlib.fault.peer_sockets)")
parser.add_argument("--join-death", default="",
                    help="the point of the joining (commlib.elastic.spares._JOIN_HOOK): "
                         "called, assembled, receiving, received")
args = parser.parse_args()
reference = [int(c) for c in args.reference.split(",") if c]
scenarios = json.loads(args.scenarios) if args.scenarios else []
FT = not (reference or scenarios or args.no_ft)
# as docs/guide/fault-tolerance.md says to launch: fault-tolerant mode from the environment,
# known before MPI starts (commlib then starts UCX without rendezvous inside a machine,
# commlib.mpi.ucx_env)
os.environ["COMMLIB_FAULT_TOLERANT"] = "1" if FT else "0"

import commlib  # noqa: E402
from commlib import elastic  # noqa: E402
from commlib.elastic import recovery as recovery_module  # noqa: E402
from commlib.elastic import state as state_module  # noqa: E402
from elastic_common import write_shm  # noqa: E402

if os.environ.get("ELASTIC_DUMP"):  # debugging: every rank's stacks after that long
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ["ELASTIC_DUMP"]), exit=True)
torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)
commlib.init(fault_tolerant=FT)
me = commlib.get_rank()
n0 = commlib.get_world_size()
from commlib.primitives import ft as _ft  # noqa: E402

remote_watches: list[list[int]] = []  # (--other-machines) the ranks watched by connection
if args.other_machines:
    from commlib.fault import failure_detection as _fd
    _fd.boot_id = lambda: f"other-machine-{os.getpid()}"
    _watch_grown = _fd.Watcher.watch_grown

    def _recording_watch_grown(self, *a, **kw):
        _watch_grown(self, *a, **kw)
        remote_watches.append(sorted(self.remote.watched) if self.remote else [])

    _fd.Watcher.watch_grown = _recording_watch_grown

# a replacement spawned by run(replace=True) has a rank of the grown world, which a living
# rank may have too: its segments under a name of its own (its results: see name_spawned)
write_shm(args.outdir, 1000 + os.getpid() if _ft.joined else me)


def _first_replacement(outdir: str, marker: str = "replacement-victim") -> bool:
    """Whether this is the first replacement spawned in the job (it creates the marker)."""
    try:
        os.close(os.open(os.path.join(outdir, marker),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


victims = [int(v) for v in args.victims.split(",")]
at = [int(k) for k in args.at.split(",")]
plan = dict(zip(victims, at))
if _ft.joined:  # a replacement spawned by run(replace=True): it is no victim
    plan = {}
    if args.replacement_dies_at and _first_replacement(args.outdir):
        plan = {me: args.replacement_dies_at}
recovery_module._SKIP_AGREEMENT = args.skip_agreement
if args.skip_spare_state:
    from commlib.elastic import spares as _spares_module
    _spares_module._SKIP_STATE = True

KWARGS = {"decentralized": {"peer_selection_mode": "shift_one"},
          "local_sgd": {"sync_every": 4},
          # the paper's outer SGD (lr 0.7, Nesterov momentum 0.9): its momentum is state
          "diloco": {"sync_every": 4},
          # two fragments, each exchange overlapping one inner step, half merged
          "streaming_diloco": {"sync_every": 4, "num_fragments": 2, "fragment_sync_delay": 1,
                               "fragment_update_alpha": 0.5},
          # compressed from step 4 on: residuals, warm-started P and Q in the state
          "powersgd": {"rank": 2, "start_iter": 4},
          "low_precision_decentralized": {"chunk_size": 64},
          # 1-bit compressed momentum from step 4 on (worker and server residuals)
          "qadam": {"warmup_steps": 4, "chunk_size": 64},
          # outer steps every 4 steps; 8 of each 64 values sent, 2 bits each, error feedback
          "sparseloco": {"sync_every": 4, "chunk_size": 64, "density": 1 / 8},
          # outer steps every 4 steps, 2-bit statistical quantizer, error feedback (decay 0.9)
          "muloco": {"sync_every": 4},
          # every step: 4 of each 8-coefficient DCT block sent, the rest kept in the momentum
          "demo": {"chunk_size": 8, "topk": 4}}
BATCH, LENGTH = 24, 24 * 40
g = torch.Generator().manual_seed(1234)
X = torch.randn(LENGTH, 16, generator=g)
Y = torch.randn(LENGTH, 4, generator=g)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    w = args.width
    return torch.nn.Sequential(torch.nn.Linear(16, w), torch.nn.Tanh(),
                               torch.nn.Linear(w, w), torch.nn.Tanh(),
                               torch.nn.Linear(w, 4))


class Training:
    """One training from the initial model: model, optimizer, sampler, elastic state."""

    def __init__(self, algorithm: str, scale_lr: bool) -> None:
        self.algorithm = algorithm
        self.model = make_model()
        if algorithm == "qadam":  # its own optimizer (momentum exchanged compressed)
            from commlib.algorithms.qadam import QAdamOptimizer
            self.optimizer = QAdamOptimizer(self.model.parameters(), lr=0.01)
        elif algorithm == "demo":  # DeMo's sign update, to plain SGD (its momentum is DeMo's)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        else:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.sampler = elastic.ElasticSampler(LENGTH, BATCH, seed=7)
        self.state = elastic.State(self.model, self.optimizer, self.sampler, ledger=[],
                                   scale_lr=scale_lr)
        self.times: list[tuple[int, float]] = []
        self.ring: bool | None = None   # low_precision_decentralized: see ring_consistent

    def ring_consistent(self) -> None:
        """``low_precision_decentralized`` (collective over the state's group): whether
        each rank's copies of its ring neighbours' weights equal their ``x_pub`` (after a
        shrink the neighbours changed: the copies must have been rebuilt)."""
        from commlib.algorithms.low_precision_decentralized import LowPrecisionDecentralized
        from commlib.primitives.decentralized import ring_neighbors
        algo = self.state._wrapper.algorithm if self.state._wrapper is not None else None
        if not isinstance(algo, LowPrecisionDecentralized):
            return
        group = self.state.group
        left, right = ring_neighbors(group.rank, group.size)
        ok = True
        for rep in algo._replicas:
            every = commlib.allgather(rep["pub"], group=group)
            ok &= bool(torch.equal(rep["left"], every[left]) and
                       torch.equal(rep["right"], every[right]))
        self.ring = ok

    def write(self, outdir: str) -> None:
        params = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        st = self.state
        with open(os.path.join(outdir, f"rank{me}.json"), "w") as f:
            json.dump({"rank": me, "step": st.step, "ledger": st.ledger,
                       "recoveries": [{k: (v if k != "values" else
                                           {str(a): b for a, b in v.items()})
                                       for k, v in r.items()} for r in st.recoveries],
                       "params": params.numpy().tobytes().hex(), "times": self.times,
                       "size": st.group.size, "world": n0, "ring": self.ring,
                       "lr": self.optimizer.param_groups[0]["lr"],
                       "remote_watches": remote_watches}, f)


run = Training(args.algorithm, args.scale_lr)
state = run.state  # the main training's (the fault's record names its step)


def record_fault(kind: str) -> None:
    with open(os.path.join(args.outdir, f"fault{me}.json"), "w") as f:
        json.dump({"rank": me, "kind": kind, "time": time.time(), "step": state.step}, f)


def die(kind: str) -> None:
    record_fault(kind)
    if kind in ("kill", "lag"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "exit":
        os._exit(7)
    elif kind == "sysexit":
        sys.exit(0)


def wrap(tr: Training) -> commlib.DistributedDataParallel:
    return tr.state.wrap(algorithm=tr.algorithm, bucket_cap_mb=args.bucket_mb,
                         **KWARGS.get(tr.algorithm, {}))


def one_step(tr: Training, ddp, faults: bool = True) -> None:
    st = tr.state
    step, group = st.step, st.group
    idx = tr.sampler.indices(step, group.rank, group.size)
    fault = faults and plan.get(me) == step and args.fault
    if fault == "idlekill":  # a victim that trains is killed as by "kill"
        fault = "kill"
    if fault == "killfwd":  # dies mid-forward: the first layer computed
        tr.model[2].register_forward_hook(lambda *a: die("kill"))
    if fault == "killcommit":  # dies inside commit: stepped and counted, not recorded
        st.__dict__["_record"] = lambda *a, **k: die("kill")
    out = ddp(X[idx])  # (local_sgd: the pending average first)
    if fault == "lagavg":
        die("kill")
    if fault in ("kill", "exit"):
        hidden = out.grad_fn.next_functions[1][0]  # dies mid-backward, buckets in flight
        hidden.register_hook(lambda *a: die(fault))
    loss = torch.nn.functional.mse_loss(out, Y[idx])
    loss.backward()
    if fault == "lag":
        die("lag")
    if faults and args.fault == "lag" and me == 1 and step == plan.get(victims[0]) and \
            not getattr(st, "_lagged", False):
        st.__dict__["_lagged"] = True
        while victims[0] not in commlib.fault.fault_tolerance.dead():
            time.sleep(0.005)
        raise commlib.PeerFailure("injected: this rank acts as if its exchange failed",
                                  failed=[victims[0]])
    tr.optimizer.step()
    tr.optimizer.zero_grad(set_to_none=True)
    st.ledger.append([step + 1, group.size])
    # (the step is done: recorded before commit, which a refill of spares leaves from)
    tr.times.append((step + 1, time.time()))
    st.commit()
    if faults and args.pause:
        time.sleep(args.pause)
    if faults and args.fault == "idlekill" and me == 0 and st.step in plan.values():
        open(os.path.join(args.outdir, f"committed{st.step}"), "w").close()


def idle_kill(victim_step: int) -> None:
    """``idlekill``: this spare SIGKILLs itself (standing by) once rank 0 committed the
    step."""
    import threading
    marker = os.path.join(args.outdir, f"committed{victim_step}")

    def watch() -> None:
        while not os.path.exists(marker):
            time.sleep(0.01)
        die("kill")

    threading.Thread(target=watch, daemon=True).start()


def lag_average() -> None:
    """``lagavg`` on rank 1: the average of step ``K`` completes, then raises PeerFailure
    before it is applied (as if the wait had been given up on just after the data came)."""
    from commlib.algorithms.buckets import pack
    from commlib.algorithms.local_sgd import LocalSGD
    from commlib.base.reduce_ops import ReduceOp
    from commlib.primitives import allreduce as _allreduce
    original = LocalSGD._average
    k, victim = plan.get(victims[0]), victims[0]

    def _average(self, ctx) -> None:
        if ctx.step != k or getattr(lag_average, "done", False):
            return original(self, ctx)
        lag_average.done = True
        works = [_allreduce(pack(b), op=ReduceOp.AVG, group=ctx.group, async_op=True)
                 for b in ctx.buckets]
        for work in works:
            work.wait()
        while victim not in commlib.fault.fault_tolerance.dead():
            time.sleep(0.005)
        raise commlib.PeerFailure("injected: this rank acts as if its average failed",
                                  failed=[victim])

    LocalSGD._average = _average


if args.fault == "lagavg" and me == 1 and not reference and not scenarios:
    lag_average()
if args.replacement_join_death and _ft.joined and _first_replacement(args.outdir,
                                                                        "join-victim"):
    from commlib.elastic import spares as _spares_module
    _spares_module._JOIN_HOOK = lambda point: (die("kill") if point ==
                                               args.replacement_join_death else None)
if me == args.join_victim and args.join_death and not _ft.joined:
    from commlib.elastic import spares as _spares_module

    def _join_hook(point: str) -> None:
        if point == args.join_death:
            die("kill")

    _spares_module._JOIN_HOOK = _join_hook


def train(st: elastic.State) -> None:
    ddp = wrap(run)
    if args.forget_own_state and st.recoveries:  # wrong on purpose: the negative control
        ddp.algorithm.reset_own_state()
    while st.step < args.steps:
        if plan.get(me) == st.step and args.fault == "sysexit":
            die("sysexit")
        one_step(run, ddp)


def train_reference(tr: Training, gone: list[int], at: list[int]) -> bool:
    """The same steps without faults; ranks ``gone`` leave after the committed steps
    ``at`` (as run() shrinks, and with the learning rate scaled as run() scales it).
    Returns whether this rank trained to the end."""
    st = tr.state
    st.__dict__["group"] = commlib.world()
    ddp = wrap(tr)
    alive = list(range(n0))
    marks = list(zip(at, gone))
    while st.step < args.steps:
        while marks and st.step == marks[0][0]:
            _, victim = marks.pop(0)
            if state_module.POLICIES.get(tr.algorithm) == state_module.SYNCED:
                # the average (outer step) of the last step, as run() commits it
                ddp._start_iteration(reset=False)
            algo = ddp.algorithm.state_dict()
            old = len(alive)
            alive.remove(victim)
            group = commlib.new_group(alive, parent=st.group)
            if me == victim:
                tr.state.close_wrapper()
                return False
            st.close_wrapper()
            st.drop_gradients()
            st.__dict__["group"] = group
            if tr.algorithm != "gradient_allreduce":
                st.__dict__["_algorithm_state"] = algo
            if st.scale_lr:
                for param_group in tr.optimizer.param_groups:
                    param_group["lr"] *= len(alive) / old
            ddp = wrap(tr)
        one_step(tr, ddp, faults=False)
    st.close_wrapper()
    return True


def name_spawned() -> None:
    """Collective over the final group (``--replace``): each replacement spawned by
    ``run`` takes, in group order, the smallest rank number no original member has (the
    rank of the grown world may be a living rank's: victims 0 and 1 of 4 leave ranks 2 and
    3, which are ranks 0 and 1 of the grown world, and the replacement 2); what names its
    ``rank{r}.json`` (the dead rank's number when the last rank was replaced)."""
    global me
    names = commlib.allgather(torch.tensor([-1 if _ft.joined else me]), group=state.group)
    names = [int(x) for x in names.reshape(-1)]
    free = (r for r in range(len(names) + 64) if r not in names)
    mine = {i: next(free) for i, x in enumerate(names) if x < 0}
    if _ft.joined:
        me = mine[state.group.rank]


def parse(spec: str) -> list[int]:
    return [int(c) for c in spec.split(",") if c]


if scenarios:  # several references in one job, each in OUTDIR/<name>/
    for sc in scenarios:
        tr = Training(sc.get("algorithm", args.algorithm), bool(sc.get("scale_lr")))
        sub = os.path.join(args.outdir, sc["name"])
        os.makedirs(sub, exist_ok=True)
        if train_reference(tr, parse(sc.get("victims", "")), parse(sc.get("steps", ""))):
            tr.write(sub)
        commlib.barrier()
    sys.exit(0)
if reference:
    finished = train_reference(run, victims, reference)
    if not finished:  # stays until the end (a rank leaving early upsets hydra's proxies)
        commlib.barrier()
        sys.exit(0)
else:
    hosts = os.environ.get("ELASTIC_HOSTS", "").split(",")  # a dead rank's host, if known
    if args.fault == "idlekill" and me in plan and me >= n0 - args.spares:
        idle_kill(plan[me])
    cpu0, wall0 = time.process_time(), time.monotonic()
    elastic.run(train, state, replace=args.replace, min_ranks=args.min_ranks,
                spawn_info=lambda dead: {"host": hosts[dead[0]]} if hosts[0] else None,
                spares=args.spares, refill=args.refill)
    if state.group.rank < 0:  # a spare released at the end: its CPU time inside run()
        with open(os.path.join(args.outdir, f"spare{me}.json"), "w") as f:
            json.dump({"rank": me, "step": state.step, "spares": state.spares,
                       "cpu_s": time.process_time() - cpu0,
                       "wall_s": time.monotonic() - wall0}, f)
        sys.exit(0)
if not reference:
    run.ring_consistent()
    if FT and (args.replace or args.refill):
        name_spawned()
run.write(args.outdir)
if reference:
    commlib.barrier()
