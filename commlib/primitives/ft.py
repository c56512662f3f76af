"""Shrinking and growing fault-tolerant groups (``COMMLIB_FAULT_TOLERANT=1``).

:func:`shrink` is what a survivor calls after :class:`~commlib.base.errors.PeerFailure`: the
survivors agree (:mod:`commlib.fault.agreement`) on who is left and on a value each brings (the
step it committed), then build their communicator with ``MPI_Comm_create_group`` over a
control communicator, or ``MPI_Comm_create_from_group`` under ULFM
(:meth:`commlib.fault.ft_backend.Backend.create`; only survivors take part; on a helper thread,
abandoned if another rank dies meanwhile, and the agreement runs again). A creation that
neither ends nor fails within :func:`create_limit` is abandoned too and the survivors agree
again and build it under a new name (once in ~250 Open MPI jobs under load every survivor's
``MPI_Comm_create_from_group`` hung with every member alive); after
:data:`CREATE_ATTEMPTS` such attempts ``shrink`` raises :class:`CommError`. :func:`grow`
adds spawned ranks.
"""
from __future__ import annotations

import threading
from typing import Any

from mpi4py import MPI

from ..base.errors import CommError, PeerFailure, where
from ..base.options import options
from ..core import exits, runtime
from ..core.communicator import Communicator
from ..fault import failure_detection, fault_tolerance, peer_sockets
from ..fault.agreement import Agreement, Decision
from ..fault.ft_backend import backend
from ..fault.helper_thread import CREATE_ATTEMPTS, create_limit  # noqa: F401 - API
from ..mpi import launch, shutdown

#: Tags of the survivors' ``MPI_Comm_create_group`` calls on the control communicator.
CREATE_TAG_BASE = 1000
#: Tries of ``MPI_Comm_spawn`` in :func:`grow` before it raises.
SPAWN_ATTEMPTS = 3
#: Seconds :func:`grow` lets pass after the last death it knows before it spawns. Under
#: hydra (mpiexec -disable-auto-cleanup, one proxy per rank) an ``MPI_Comm_spawn`` started
#: right after a death hung now and then, for good: no proxy was ever launched and the
#: spawning ranks spun inside ``MPI_Comm_spawn`` (warm spare used up, then a second death:
#: 3 of 4 and 2 of 4 runs with ranks 0 and 1 dying, 1 of 3 with ranks 0 and 2; none of 10
#: with a pause of 0.5 or 1.5 s before the spawn). The cause inside hydra was not found
#: (pausing commlib's own PMI reads of the dead during the spawn did not help: 5 of 5
#: hung). A sleep only where a death was seen less than this long ago.
SPAWN_SETTLE_S = 1.0

_ctl: Any = None
_agreement: Agreement | None = None
_lock = threading.Lock()


def _start() -> None:
    """At :func:`commlib.init` in fault-tolerant mode (collective over the world, every
    rank alive): the control communicator and the failure watcher. A process spawned by
    :func:`grow` joins its parents' world here."""
    global _ctl, _agreement, joined
    if not options.fault_tolerant or _ctl is not None:
        return
    if runtime._world_source is not None and runtime._world_source != MPI.COMM_WORLD:
        raise CommError(f"{where('init', MPI.COMM_WORLD.Get_rank())}: fault-tolerant mode "
                        f"needs commlib's world to be MPI_COMM_WORLD")
    fault_tolerance.watcher()
    parent = MPI.Comm.Get_parent()
    if parent != MPI.COMM_NULL:  # a replacement: the survivors wait in grow()
        joined = True
        exits.arm(collective=False)  # (its status recorded: sys.exit, uncaught exceptions)
        shutdown.at_final(exits.leave_alone)  # never MPI_Finalize, as the survivors
        merged = parent.Merge(high=True)
        _adopt_world(merged, runtime._world)
        return
    _ctl = MPI.COMM_WORLD.Dup()
    _agreement = Agreement(_ctl)


#: Whether this process was spawned by :func:`grow` (it joined a running job).
joined = False
#: On a process spawned by :func:`grow`: the ``note`` its parents passed (None without).
joined_note: Any = None


runtime.on_init(_start)


def agreement() -> Agreement:
    """The process's agreement (fault-tolerant mode only)."""
    if _agreement is None:
        if not options.fault_tolerant:
            raise CommError(f"{where('shrink', MPI.COMM_WORLD.Get_rank())}: groups can only "
                            f"shrink in fault-tolerant mode (COMMLIB_FAULT_TOLERANT=1 or "
                            f"commlib.init(fault_tolerant=True))")
        runtime.world()
        _start()
    return _agreement


def _dead_or_left() -> frozenset[int]:
    w = fault_tolerance.watcher()
    return w.dead | frozenset(w.to_base(exits.left_ranks()))


class _Pending:
    """``failed``/``failure`` of a communicator being built by the survivors of
    ``decision``, who knew ``known_dead`` dead (for :func:`fault_tolerance.in_thread`)."""

    def __init__(self, decision: Decision, known_dead: frozenset,
                 members_only: bool = False) -> None:
        self.decision = decision
        self.known_dead = known_dead
        self.watcher = fault_tolerance.watcher()
        # only a member's death stops the creation (assemble: deaths outside are agreed)
        self.scope = frozenset(decision.members) if members_only else None

    def _new(self) -> frozenset:
        new = self.watcher.dead - self.known_dead
        return new if self.scope is None else new & self.scope

    @property
    def failed(self) -> bool:
        return bool(self._new())

    def failure(self, op: str) -> PeerFailure:
        gone = sorted(self._new())
        return PeerFailure(f"commlib.shrink (rank {MPI.COMM_WORLD.Get_rank()}): rank(s) "
                           f"{gone} failed while the survivors built their communicator",
                           failed=gone, world_ranks=self.decision.members)


def shrink(comm: Communicator, value: Any = 0,
           timeout: float | None = None) -> tuple[Communicator, Decision]:
    """Collective over the survivors of the communicator ``comm``: the communicator of the
    members still alive, in the same order, and the :class:`Decision` (see
    :func:`commlib.primitives.group.shrink`, which makes a group of it)."""
    limit = float(options.timeout if timeout is None else timeout)
    mpi, decision, known, key = _agree_and_create(
        tuple(comm.world_ranks), value, limit, frozenset(getattr(comm.mpi, "known_dead", ())),
        CREATE_TAG_BASE)
    name = f"{comm.name}/shrunk{len(decision.dead)}"
    new = Communicator(fault_tolerance.adopt(mpi, known, name, key), comm.watchdog, name,
                       decision.members)
    if comm is runtime._world:
        runtime._world = new
    return new, decision


#: Tags of the communicator creations of :func:`assemble` (apart from the shrinks': a
#: creation given up on stays inside MPI and must never match a later one).
ASSEMBLE_TAG_BASE = 3000


def assemble(universe: tuple[int, ...], value: Any = 0, timeout: float | None = None,
             name: str = "assembled") -> tuple[Communicator, Decision]:
    """Collective over the living ranks of ``universe`` (world ranks, in order; every
    caller passes the same ``universe`` and is in it; no communicator is needed in
    common): they agree as :func:`shrink`'s survivors do (a rank of ``universe`` dead
    before or during the call is left out, the others agree again) and get the
    communicator of the living ones, in the order of ``universe``, and the
    :class:`Decision`. What brings idle ranks (the spares of :mod:`commlib.elastic`) into
    a group: the group's survivors and the ranks that join call it with the same
    ``universe``.

    The ranks outside ``universe`` that the new communicator counts as dead (its failure
    domain is the whole job, as every fault-tolerant communicator's) are agreed too: every
    member brings the dead it knows with its value and the communicator knows their union,
    the same on every member (a survivor of a group knows its dead peer before a joining
    rank's detector sees it: otherwise that death would fail the communicator on the
    joining rank alone). A death outside ``universe`` during the creation does not stop it;
    the communicator has failed then, on every member alike."""
    universe = tuple(int(r) for r in universe)
    limit = float(options.timeout if timeout is None else timeout)
    mpi, decision, known, key = _agree_and_create(universe, value, limit, frozenset(),
                                                  ASSEMBLE_TAG_BASE, agreed_dead=True)
    label = f"{name}{list(decision.members)}"
    new = Communicator(fault_tolerance.adopt(mpi, known, label, key),
                       runtime.world().watchdog, label, decision.members)
    return new, decision


def expect_exit(comm: Communicator, ranks: Any) -> None:
    """The world ranks ``ranks`` (outside ``comm``) are about to leave the program on
    purpose (released spares): their exit is no failure of ``comm`` (every operation of a
    fault-tolerant communicator otherwise fails once any rank of the job is gone)."""
    mpi = comm.mpi
    outside = frozenset(int(r) for r in ranks) - frozenset(comm.world_ranks)
    if hasattr(mpi, "known_dead") and outside:
        mpi.known_dead = frozenset(mpi.known_dead) | outside


def become_world(comm: Communicator) -> None:
    """``comm`` holds every living rank of the world (all others are dead): it is
    commlib's world from now on (what :func:`shrink` does when it shrinks the world), so
    that it can :func:`grow`. Raises :class:`CommError` naming the living ranks outside."""
    old = runtime.world()
    if comm is old:
        return
    gone = frozenset(fault_tolerance.dead()) | frozenset(getattr(comm.mpi, "known_dead", ()))
    outside = [r for r in old.world_ranks if r not in gone and r not in comm.world_ranks]
    if outside:
        raise CommError(f"{where('become_world', comm.rank)}: world rank(s) {outside} are "
                        f"alive and outside the communicator {list(comm.world_ranks)}")
    runtime._world = comm


def _agree_and_create(universe: tuple[int, ...], value: Any, limit: float,
                      prior: frozenset, tag_base: int,
                      agreed_dead: bool = False
                      ) -> tuple[Any, Decision, frozenset, str | None]:
    """The survivors' agreement over ``universe`` and their MPI communicator (on the
    control communicator; see :func:`shrink`); returns it, the decision, the ranks it
    knows dead (``prior`` among them) and its :attr:`~commlib.fault.fault_tolerance.
    FTComm.key` (the name of the creation, where the backend derives communicators from
    it with its ``create``: Open MPI; else None). ``agreed_dead`` (:func:`assemble`): the dead outside
    ``universe`` are the union of those the members know, agreed with the values."""
    ag = agreement()
    timeouts = 0
    with _lock:
        while True:
            if agreed_dead:
                decision = ag.decide(universe, (value, _dead_or_left()), _dead_or_left,
                                     limit)
                seen = frozenset().union(*(d for _, d in decision.values.values()))
                decision = Decision(decision.members, decision.dead,
                                    {r: v for r, (v, _) in decision.values.items()},
                                    decision.generation)
                outside = frozenset(r for r in seen if r not in universe)
            else:
                decision = ag.decide(universe, value, _dead_or_left, limit)
                # Dead before, or outside the group (they do not concern its members).
                outside = frozenset(fault_tolerance.dead()) - frozenset(universe)
            known = prior | outside | decision.dead
            index = {w: i for i, w in enumerate(_ctl_ranks())}
            members = _ctl.Get_group().Incl([index[r] for r in decision.members])
            tag = tag_base + len(decision.dead) * 64 + decision.generation % 64
            # names this decision alike on every survivor (and no other decision)
            key = (f"{fault_tolerance.watcher().epoch}/{universe}/"
                   f"{sorted(decision.dead)}/{decision.generation}/{timeouts}")
            b = backend()
            try:
                mpi = fault_tolerance.in_thread(_Pending(decision, known, agreed_dead),
                                                b.create_op,
                                                b.create, _ctl, members, tag, key,
                                                limit_s=create_limit())
            except PeerFailure:
                continue  # another rank died meanwhile: agree again without it
            except fault_tolerance.CallTimedOut as exc:
                timeouts += 1  # every survivor's timed out alike: agree again, a new name
                if timeouts >= CREATE_ATTEMPTS:
                    raise CommError(f"{where('shrink', MPI.COMM_WORLD.Get_rank())}: the "
                                    f"survivors' communicator was not built in "
                                    f"{CREATE_ATTEMPTS} attempts of {create_limit():g} s "
                                    f"each ({exc})") from None
                continue
            finally:
                members.Free()
            return mpi, decision, known, (f"{tag}/{key}" if b.derive_by_create else None)


def spawn_refusal() -> str:
    """Why no process can be spawned here for :func:`grow` ('' where it can): the MPI
    library's own reason, or a world formed without ``mpiexec`` (the store-backed launch:
    no process manager to spawn with)."""
    if launch.current() is not None:
        return ("the world was formed from a store (RANK, WORLD_SIZE, MASTER_ADDR), "
                "without mpiexec: no process manager spawns processes")
    return backend().impl.spawn_refusal


def grow(comm: Communicator, n: int, command: str | None = None,
         args: list[str] | None = None, info: dict[str, str] | None = None,
         note: Any = None) -> Communicator:
    """Collective over ``comm`` (the world, every member alive): spawn ``n`` processes
    running ``command args`` (default: this Python and ``sys.argv``: the same script)
    with ``MPI_Comm_spawn`` (``info``: its ``MPI_Info`` keys, e.g. ``{"host": ...}``) and
    merge them in after the members; the merged communicator is the world from then on
    (ranks ``0..size-1``: the members in order, then the newcomers). The newcomers join in
    their ``commlib.init()``, where :data:`joined_note` is ``note`` (picklable: e.g. what
    they are to do, told without a collective after the grow). A failure meanwhile raises
    :class:`PeerFailure`."""
    import sys
    import time
    if comm is not runtime._world:
        raise CommError(f"{where('grow', comm.rank)}: only the world grows (shrink it first)")
    refusal = spawn_refusal()
    if refusal:  # every member raises alike
        raise CommError(f"{where('grow', comm.rank)}: no replacement can be spawned on "
                        f"{backend().impl.describe()}: {refusal}")
    settle = SPAWN_SETTLE_S - (time.monotonic() - fault_tolerance.watcher().changed_at)
    if settle > 0:
        time.sleep(settle)
    mpi_info = MPI.Info.Create()
    for key, value in (info or {}).items():
        mpi_info.Set(str(key), str(value))
    try:
        for attempt in range(SPAWN_ATTEMPTS):
            try:
                inter = fault_tolerance.in_thread(
                    comm.mpi, "Comm_spawn", MPI.Intracomm.Spawn, comm.mpi,
                    command or sys.executable, list(sys.argv if args is None else args),
                    int(n), mpi_info, 0)
                break
            except fault_tolerance.CallTimedOut as exc:
                known = backend().impl.respawn_bug
                if known and fault_tolerance.watcher().epoch:  # (a spawn came before)
                    raise CommError(f"{exc}; a known bug of {backend().impl.describe()}: "
                                    f"{known}") from None
                raise
            except MPI.Exception as exc:
                # hydra refuses a spawn now and then right after a death ("Error in spawn
                # call", 2 of 8 benchmark runs); MPICH tells every member (the root's
                # result is broadcast), so all retry alike.
                if attempt == SPAWN_ATTEMPTS - 1:
                    raise CommError(f"{where('grow', comm.rank)}: MPI_Comm_spawn of {n} "
                                    f"rank(s) failed {SPAWN_ATTEMPTS} times: "
                                    f"{exc.Get_error_string()}") from exc
                print(f"commlib.grow (rank {comm.rank}): MPI_Comm_spawn failed, retrying: "
                      f"{exc.Get_error_string()}", file=sys.stderr, flush=True)
                time.sleep(0.2 * (attempt + 1))
    finally:
        mpi_info.Free()
    merged = fault_tolerance.in_thread(comm.mpi, "Intercomm_merge", MPI.Intercomm.Merge,
                                       inter, False)
    return _adopt_world(merged, comm, note)


def _adopt_world(merged: Any, old: Communicator, note: Any = None) -> Communicator:
    """``merged`` (survivors and newcomers, all alive) becomes the world: failure
    detection counts in its ranks, a new control communicator, commlib's world."""
    global _ctl, _agreement, joined_note
    watcher = fault_tolerance.watcher()
    watcher.rebase(merged)
    _ctl = merged.Dup()
    _agreement = Agreement(_ctl)
    size = merged.Get_size()
    name = f"world/grown{size}"
    ftcomm = fault_tolerance.adopt(merged, None, name)
    # The newcomers' processes (and, for them, their parents') are in no MPI_COMM_WORLD
    # that this process's failure detection covers: watch them by process id (a death in
    # this exchange: the old world's are seen, a newcomer's is caught by its time limit).
    # (and on other machines by a TCP connection to each one's watch port)
    # (the parents' note travels with the reports: rank 0 is a parent)
    reports = fault_tolerance.in_thread(ftcomm, "Allgather", merged.allgather,
                                        (failure_detection.this_process(),
                                         peer_sockets.listener().address(), note))
    if joined:
        joined_note = reports[0][2]
    watcher.watch_grown({r: p for r, (p, _, _) in enumerate(reports)}, merged.Get_rank(),
                        {r: a for r, (_, a, _) in enumerate(reports)})
    new = Communicator(ftcomm, old.watchdog, name, tuple(range(size)))
    runtime._world = new
    return new


def _ctl_ranks() -> list[int]:
    return list(range(_ctl.Get_size()))
