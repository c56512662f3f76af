"""The communicator layer: one MPI communicator plus what every collective needs around it.

A :class:`Communicator` owns an ``MPI.Comm`` and adds sequence numbers, the watchdog
deadline of blocking calls, checking mode (every rank agrees on the call before it is
made), and the node topology used by hierarchical collectives. It knows nothing of any
particular collective: primitives call :meth:`Communicator.verify`, :meth:`arm` and
:meth:`disarm` around their MPI calls.
"""
from __future__ import annotations

from threading import get_ident
from time import monotonic
from typing import Any

from mpi4py import MPI

from ..base.errors import CommError, where
from ..base.options import options
from ..mpi.watchdog import Watchdog


def describe_pending(pending: tuple) -> str:
    """Text for a watchdog entry ``(op, seq, what, comm)``; built only if the watchdog
    fires, so arming costs a tuple and no formatting."""
    op, seq, what, comm = pending
    what = what.describe() if hasattr(what, "describe") else str(what)
    return f"{op} #{seq} with {what} on {comm.describe()} (rank {comm.rank} of {comm.size})"


#: Seconds between tests while a blocking call or a ``Work.wait()`` waits for MPI (0: block
#: inside MPI). Set by ``commlib.init`` for the whole job before the world is made (option
#: ``wait_poll_us``); every communicator takes it at construction.
WAIT_POLL_S = 0.0
#: The same on every process of this process's ``MPI_COMM_WORLD``, different in another's
#: (a process spawned into a grown world has its own): set by ``runtime.init``.
WORLD_KEY = 0


class Gate:
    """Start order of multi-stage operations on one communicator (see
    :mod:`commlib.primitives.work`): tickets handed out in issue order, the ticket whose
    operation may start now, the operations holding tickets, tickets released early."""
    __slots__ = ("issued", "turn", "holders", "released")

    def __init__(self) -> None:
        self.issued = 0
        self.turn = 0
        self.holders: dict[int, Any] = {}
        self.released: set[int] = set()

    def take(self, holder: Any) -> int:
        ticket = self.issued
        self.issued += 1
        if holder is not None:
            self.holders[ticket] = holder
        return ticket


class Communicator:
    """An MPI communicator with commlib's bookkeeping. ``rank``/``size`` are within it."""

    def __init__(self, mpi_comm: Any, watchdog: Watchdog, name: str,
                 world_ranks: tuple[int, ...] | None = None) -> None:
        if options.fault_tolerant:  # every operation nonblocking, failures detected
            from ..fault.fault_tolerance import adopt
            mpi_comm = adopt(mpi_comm, name=name)
        self.mpi = mpi_comm
        # fault-tolerant communicators wait through their own waiter thread
        self.poll_s = 0.0 if options.fault_tolerant else WAIT_POLL_S
        self.watchdog = watchdog
        self.name = name
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()
        if world_ranks is None:
            world_ranks = tuple(mpi_comm.allgather(MPI.COMM_WORLD.Get_rank()))
        self.world_ranks = world_ranks
        self.seq = 0
        self._check_comm: Any = None
        self._node: tuple[Communicator, Communicator | None] | None = None
        self._node_bcast: Communicator | None = None
        self.gate = Gate()
        self.abandoned: list[Any] = []  # operations given up on (see abandon)
        #: Called (no arguments, collective like free itself) by :meth:`free` before the
        #: MPI communicators are freed: what a layer above made on this communicator (the
        #: shared-memory window of commlib.primitives.node_shm).
        self.on_free: list[Any] = []

    # -- bookkeeping around blocking calls -------------------------------------------------
    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def arm(self, op: str, what: Any) -> None:
        """Start the deadline of the calling thread's blocking call (see
        :mod:`commlib.mpi.watchdog`; written out here because it runs on every collective)."""
        self.watchdog.armed[get_ident()] = (monotonic() + options.timeout,
                                            (op, self.seq, what, self))

    def disarm(self) -> None:
        self.watchdog.armed.pop(get_ident(), None)

    def describe(self) -> str:
        ranks = self.world_ranks
        if len(ranks) > 8:
            span = f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}]"
        else:
            span = list(ranks)
        return f"group {self.name!r} (world ranks {span})"

    def check_rank(self, value: Any, name: str, op: str) -> int:
        """Validate a rank argument (``src``, ``dst``, ...) within this communicator."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where(op, self.rank)}: argument {name!r} must be an int rank, "
                            f"got {type(value).__name__}")
        if not 0 <= value < self.size:
            raise ValueError(f"{where(op, self.rank)}: argument {name!r}={value} is out of "
                             f"range; {self.describe()} has ranks 0..{self.size - 1}")
        return value

    # -- checking mode ---------------------------------------------------------------------
    @property
    def checking(self) -> bool:
        return options.check

    def verify(self, op: str, signature: dict[str, Any]) -> None:
        """Collective: every rank must pass the same ``op`` and ``signature``.

        On disagreement every rank raises the same :class:`CommError`, naming the ranks and
        what each passed; the MPI call is then never made, so nothing hangs or truncates.
        """
        if self._check_comm is None:
            self._check_comm = self.mpi.Dup()
        mine = (op, tuple(sorted(signature.items())))
        self.arm("checking " + op, signature)
        try:
            calls = self._check_comm.allgather(mine)
        finally:
            self.disarm()
        if all(c == calls[0] for c in calls):
            return
        groups: dict[Any, list[int]] = {}
        for r, c in enumerate(calls):
            groups.setdefault(c, []).append(r)
        lines = [f"ranks {rs} called {c[0]}({', '.join(f'{k}={v}' for k, v in c[1])})"
                 for c, rs in groups.items()]
        raise CommError(f"{where(op, self.rank)}: ranks of {self.describe()} disagree about "
                        f"collective #{self.seq}: " + "; ".join(lines))

    # -- topology --------------------------------------------------------------------------
    def node(self) -> tuple[Communicator, Communicator | None]:
        """(ranks on my node, node leaders or None if I lead no node). Collective on first
        use. Nodes are shared-memory domains, or blocks of ``COMMLIB_LOCAL_SIZE``
        consecutive ranks when that option is set."""
        if self._node is None:
            k = options.local_size
            if k is not None:
                local = self.mpi.Split(color=self.rank // k, key=self.rank)
            else:
                local = self.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
                if options.fault_tolerant:
                    # a grown world mixes MPI_COMM_WORLDs, whose processes MPICH's split
                    # puts together but whose shared-memory window it refuses ("processes
                    # are not in the same shared memory domain"): one node per world
                    split = local.Split(color=WORLD_KEY, key=self.rank)
                    local.Free()
                    local = split
            is_leader = local.Get_rank() == 0
            leaders = self.mpi.Split(color=0 if is_leader else MPI.UNDEFINED, key=self.rank)
            local_c = Communicator(local, self.watchdog, f"{self.name}/node")
            lead_c = (Communicator(leaders, self.watchdog, f"{self.name}/leaders")
                      if is_leader else None)
            self._node = (local_c, lead_c)
            self._node_bcast = local_c.dup(f"{self.name}/node-bcast")
        return self._node

    def node_broadcast(self) -> Communicator:
        """A second communicator over my node's ranks (collective on first use, with
        :meth:`node`): hierarchical operations broadcast on it, so that the node reduces of
        later operations, started at issue, never queue behind earlier broadcasts."""
        if self._node is None:
            self.node()
        assert self._node_bcast is not None  # made by node()
        return self._node_bcast

    def split(self, member: bool, key: int, name: str) -> Communicator | None:
        """Collective over this communicator: members form a new one, ordered by ``key``."""
        sub = self.mpi.Split(color=0 if member else MPI.UNDEFINED, key=key)
        if sub == MPI.COMM_NULL:
            return None
        return Communicator(sub, self.watchdog, name)

    def create_group(self, ranks: list[int], name: str, tag: int = 0) -> Communicator:
        """Collective over the members only (``MPI_Comm_create_group``): a communicator of the
        ranks ``ranks`` of this one, in that order; only those ranks call it, with the same
        ``ranks`` and ``tag``. The caller must be one of them."""
        members = self.mpi.Get_group().Incl(ranks)
        self.arm("create_group", name)
        try:
            sub = self.mpi.Create_group(members, tag)
        finally:
            self.disarm()
            members.Free()
        return Communicator(sub, self.watchdog, name,
                            tuple(self.world_ranks[r] for r in ranks))

    def dup(self, name: str) -> Communicator:
        """Collective: a communicator over the same ranks with its own message space."""
        return Communicator(self.mpi.Dup(), self.watchdog, name, self.world_ranks)

    def abandon(self, pending: Any) -> None:
        """``pending`` (an operation on this communicator with an ``is_completed()``
        method, e.g. a :class:`commlib.Work`) is given up on: MPI cannot cancel a collective,
        so it may still complete (a late peer arrives). :meth:`free` keeps the MPI
        communicators while any such operation is unfinished."""
        self.abandoned.append(pending)

    def unfinished(self) -> list[Any]:
        """The abandoned operations that have not completed (tested now)."""
        left = []
        for pending in self.abandoned:
            try:
                if not pending.is_completed():
                    left.append(pending)
            except Exception:  # noqa: BLE001 - an operation that failed is over
                pass
        self.abandoned = left
        return left

    def free(self) -> None:
        """Release the MPI communicators behind this one (the node and leader ones and the
        checking one included); MPI has a limited number of them. Call it on every rank
        once nothing uses the communicator any more.

        A communicator with an abandoned operation that has not completed is not freed but
        kept for good (:data:`KEPT`): the operation may still complete, and Open MPI 5
        crashes (SIGSEGV in its next call) when a communicator is freed under a pending
        nonblocking collective, where the MPI standard says the free is deferred (MPICH
        does so); see :mod:`commlib.mpi.mpi_impl`."""
        release, self.on_free = self.on_free, []
        for step in release:
            step()
        comms = [self.mpi, self._check_comm]
        if self._node is not None:
            comms += [c.mpi for c in self._node if c is not None]
            comms.append(self._node_bcast.mpi)
        comms = [c for c in comms if c is not None and c != MPI.COMM_NULL]
        if self.unfinished():
            KEPT.append((self.name, comms, self.abandoned))
        else:
            for comm in comms:
                comm.Free()
        self.mpi = MPI.COMM_NULL
        self._check_comm = self._node = self._node_bcast = None


#: ``(name, MPI communicators, unfinished operations)`` of communicators freed while an
#: abandoned operation on them was unfinished: never freed (see :meth:`Communicator.free`).
KEPT: list[tuple[str, list[Any], list[Any]]] = []
