"""Groups: sub-communicators with the collectives as methods.

``commlib.new_group(ranks)`` is collective over its parent (every rank of the parent calls
it with the same ``ranks``, as in ``torch.distributed.new_group``); ranks outside ``ranks``
get a group object whose collectives raise :class:`CommError`.
``commlib.new_subgroup(ranks)`` (:func:`group_from_ranks`) is collective over the members
only: ranks outside ``ranks`` do not call it (what a torch backend needs, since torch only
asks the members of a new group to build it). Ranks passed to the
collectives of a group (``src``, ``dst``) are ranks *within* the group: group rank ``i`` is
world rank ``group.ranks[i]``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..base.errors import where
from ..base.reduce_ops import ReduceOp
from ..core import runtime
from ..core.communicator import Communicator
from .allgather import allgather, allgather_v
from .allreduce import allreduce
from .alltoall import alltoall, alltoall_v
from .barrier import barrier
from .broadcast import broadcast
from .gather import gather
from .p2p import recv, recv_any, send
from .reduce import reduce
from .reduce_scatter import reduce_scatter
from .scatter import scatter

if TYPE_CHECKING:
    from ..fault.agreement import Decision


class Group:
    """A set of ranks with its own communicator. ``rank`` is -1 on non-members."""

    def __init__(self, comm: Communicator | None, ranks: Sequence[int],
                 hierarchical: bool = False) -> None:
        self.comm = comm
        self.ranks = tuple(ranks)
        self.hierarchical = bool(hierarchical)
        #: what the survivors agreed on, on a group made by :func:`shrink` or :func:`assemble`
        self.agreement: Decision | None = None

    @property
    def is_member(self) -> bool:
        return self.comm is not None

    @property
    def rank(self) -> int:
        return self.comm.rank if self.comm is not None else -1

    @property
    def size(self) -> int:
        return len(self.ranks)

    def allreduce(self, tensor: Any, op: ReduceOp = ReduceOp.SUM, async_op: bool = False,
                  hierarchical: bool | None = None) -> Any:
        return allreduce(tensor, op, self, async_op, hierarchical)

    def reduce(self, tensor: Any, dst: int = 0, op: ReduceOp = ReduceOp.SUM,
               async_op: bool = False) -> Any:
        return reduce(tensor, dst, op, self, async_op)

    def broadcast(self, tensor: Any, src: int = 0, async_op: bool = False) -> Any:
        return broadcast(tensor, src, self, async_op)

    def allgather(self, tensor: Any, async_op: bool = False, out: Any = None) -> Any:
        return allgather(tensor, self, async_op, out)

    def allgather_v(self, tensor: Any, async_op: bool = False) -> Any:
        return allgather_v(tensor, self, async_op)

    def reduce_scatter(self, tensor: Any, op: ReduceOp = ReduceOp.SUM,
                       async_op: bool = False, out: Any = None) -> Any:
        return reduce_scatter(tensor, op, self, async_op, out)

    def alltoall(self, tensor: Any, async_op: bool = False, out: Any = None) -> Any:
        return alltoall(tensor, self, async_op, out)

    def alltoall_v(self, tensor: Any, send_splits: Sequence[int],
                   recv_splits: Sequence[int] | None = None, async_op: bool = False,
                   out: Any = None) -> Any:
        return alltoall_v(tensor, send_splits, recv_splits, self, async_op, out)

    def gather(self, tensor: Any, dst: int = 0, async_op: bool = False,
               out: Any = None) -> Any:
        return gather(tensor, dst, self, async_op, out)

    def scatter(self, out: Any, data: Any = None, src: int = 0, async_op: bool = False) -> Any:
        return scatter(out, data, src, self, async_op)

    def send(self, tensor: Any, dst: int, tag: int = 0, async_op: bool = False) -> Any:
        return send(tensor, dst, tag, self, async_op)

    def recv(self, tensor: Any, src: int, tag: int = 0, async_op: bool = False) -> Any:
        return recv(tensor, src, tag, self, async_op)

    def recv_any(self, tensor: Any, tag: int = 0, async_op: bool = False) -> Any:
        return recv_any(tensor, tag, self, async_op)

    def barrier(self, async_op: bool = False) -> Any:
        return barrier(self, async_op)

    def shrink(self, value: Any = 0, timeout: float | None = None) -> Group:
        """Fault-tolerant mode: the group of the members still alive, agreed by the
        survivors, who all call it (see :func:`shrink`)."""
        return shrink(self, value, timeout)

    def grow(self, n: int, command: str | None = None, args: list[str] | None = None,
             info: dict[str, str] | None = None, note: Any = None) -> Group:
        """Fault-tolerant mode, on the world: ``n`` new ranks join (see :func:`grow`)."""
        return grow(n, self, command, args, info, note)

    def free(self) -> None:
        """Release the group's communicators (on every member, once it is no longer used);
        its collectives raise afterwards."""
        if self.comm is not None:
            self.comm.free()
            self.comm = None

    def __repr__(self) -> str:
        return (f"<commlib.Group ranks={list(self.ranks)} rank={self.rank}"
                f"{' hierarchical' if self.hierarchical else ''}>")


_world_group: Group | None = None


def world(hierarchical: bool = False) -> Group:
    """The group of all ranks (``hierarchical=True``: a view whose allreduce defaults to the
    hierarchical algorithm)."""
    global _world_group
    comm = runtime.world()
    if hierarchical:
        return Group(comm, comm.world_ranks, hierarchical=True)
    if _world_group is None or _world_group.comm is not comm:
        _world_group = Group(comm, comm.world_ranks)
    return _world_group


def new_group(ranks: Sequence[int] | None = None, hierarchical: bool = False,
              parent: Group | None = None) -> Group:
    """Collective over ``parent`` (default: the world): a group of the given world ranks,
    in the given order (group rank ``i`` is world rank ``ranks[i]``). ``None`` means all
    ranks of the parent. Duplicates and ranks outside the parent raise ``ValueError``."""
    parent_comm = (parent or world()).comm
    if parent_comm is None:
        raise ValueError(f"{where('new_group', runtime.get_rank())}: this rank is not a member "
                         f"of the parent group")
    rank = parent_comm.rank
    if ranks is None:   # all of the parent, same order: a duplicate (no split, no allgather)
        comm = parent_comm.dup(f"group{list(parent_comm.world_ranks)}")
        return Group(comm, comm.world_ranks, hierarchical)
    ranks = [int(r) for r in ranks]
    _check_ranks(ranks, parent_comm, "new_group", rank)
    me = parent_comm.world_ranks[rank]
    member = me in ranks
    key = ranks.index(me) if member else 0
    sub = parent_comm.split(member, key, f"group{ranks}")
    if sub is not None:
        sub.world_ranks = tuple(ranks)
    return Group(sub, ranks, hierarchical)


def group_from_ranks(ranks: Sequence[int], parent: Group | None = None,
                     hierarchical: bool = False) -> Group:
    """A group of the given world ranks, built by those ranks alone (exported as
    ``commlib.new_subgroup``).

    Collective over the members only (``MPI_Comm_create_group``): every rank in ``ranks``
    calls it with the same ``ranks`` (same order: group rank ``i`` is world rank
    ``ranks[i]``), ranks outside do not call it at all. Members that build several groups
    must do so in the same order. ``parent`` (default: the world) must contain every rank
    of ``ranks``. A caller outside ``ranks``, duplicates, or ranks outside the parent raise
    ``ValueError``.
    """
    parent_comm = (parent or world()).comm
    if parent_comm is None:
        raise ValueError(f"{where('new_subgroup', runtime.get_rank())}: this rank is not a "
                         f"member of the parent group")
    ranks = [int(r) for r in ranks]
    _check_ranks(ranks, parent_comm, "new_subgroup", parent_comm.rank)
    me = parent_comm.world_ranks[parent_comm.rank]
    if me not in ranks:
        raise ValueError(f"{where('new_subgroup', parent_comm.rank)}: world rank {me} is not in "
                         f"argument 'ranks'={ranks}; only the members call new_subgroup "
                         f"(use new_group for a call on every rank)")
    index = {w: i for i, w in enumerate(parent_comm.world_ranks)}
    comm = parent_comm.create_group([index[r] for r in ranks], f"group{ranks}")
    return Group(comm, ranks, hierarchical)


def shrink(group: Group | None = None, value: Any = 0, timeout: float | None = None) -> Group:
    """Collective over the survivors of ``group`` (default: the world): the group of the
    members still alive, in the same order, on a new communicator (fault-tolerant mode,
    ``COMMLIB_FAULT_TOLERANT=1``; see :mod:`commlib.fault.fault_tolerance`).

    Call it on every survivor after :class:`~commlib.base.errors.PeerFailure` (a survivor that
    has not seen the failure yet gets it in its next collective on any fault-tolerant
    group). ``value`` (any picklable, orderable value: e.g. the step each rank has
    committed) is agreed with the others: the returned group's ``agreement``
    (:class:`commlib.fault.agreement.Decision`) has every member's value and, the same on every
    member, ``min``, ``max`` and ``holder`` (the first member holding ``max``). A rank that
    dies during the call makes the survivors agree again, without it. The world shrinks
    with it: when ``group`` is the world, ``commlib.world()``, ``get_rank()`` and
    ``get_world_size()`` describe the survivors' group afterwards (group ranks are ranks in
    the new group; the world ranks in ``group.ranks`` stay the job's). The old group's
    communicators are kept, never freed (MPI may still use them). Raises
    :class:`~commlib.base.errors.CommError` after ``timeout`` seconds (default
    ``COMMLIB_TIMEOUT``) without an agreement. Fault-tolerant mode only.
    """
    from . import ft
    comm = (group or world()).comm
    if comm is None:
        raise ValueError(f"{where('shrink', runtime.get_rank())}: this rank is not a member "
                         f"of the group")
    new, decision = ft.shrink(comm, value, timeout)
    result = Group(new, decision.members, getattr(group, "hierarchical", False))
    result.agreement = decision
    return result


def assemble(ranks: Sequence[int], value: Any = 0, timeout: float | None = None) -> Group:
    """Collective over the living ranks of ``ranks`` (world ranks, in order: every caller
    passes the same list and is in it; fault-tolerant mode): the group of those alive, in
    that order, on a new communicator, built by them alone (no common communicator is
    needed: the survivors of a group and idle ranks joining it call it alike). A rank of
    ``ranks`` dead before or during the call is left out; ``value`` and the returned
    group's ``agreement`` are as in :func:`shrink`."""
    from . import ft
    new, decision = ft.assemble(tuple(int(r) for r in ranks), value, timeout)
    result = Group(new, decision.members)
    result.agreement = decision
    return result


def grow(n: int, group: Group | None = None, command: str | None = None,
         args: list[str] | None = None, info: dict[str, str] | None = None,
         note: Any = None) -> Group:
    """Collective over the world (every member alive; fault-tolerant mode, under
    ``mpiexec``): ``n`` processes are spawned (``MPI_Comm_spawn``; default: this Python
    running ``sys.argv``, i.e. the same script; ``info``: ``MPI_Info`` keys such as
    ``{"host": "node3"}``) and merged in after the members: the returned group, of world
    ranks ``0..size-1`` (the members in their order, then the newcomers), is the world from
    then on. The newcomers join in their own ``commlib.init()`` (there
    ``commlib.primitives.ft.joined`` is True) and must then take part in whatever the
    members do next, e.g. receive the training state (``commlib.elastic.run`` does both);
    ``note`` (picklable) is ``commlib.primitives.ft.joined_note`` there.
    A failure meanwhile raises :class:`~commlib.base.errors.PeerFailure`. Not survived
    afterwards: the death of a spawned rank (hydra's ``mpiexec`` fails an assertion), and a
    death seen only by the processes of the other MPI world (``MPIX_Comm_get_failed`` reads
    each world's own list)."""
    from . import ft
    comm = (group or world()).comm
    if comm is None:
        raise ValueError(f"{where('grow', runtime.get_rank())}: this rank is not a member "
                         f"of the group")
    new = ft.grow(comm, n, command, args, info, note)
    return Group(new, new.world_ranks, getattr(group, "hierarchical", False))


def _check_ranks(ranks: list[int], parent_comm: Communicator, op: str, rank: int) -> None:
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{where(op, rank)}: argument 'ranks' has duplicates: {ranks}")
    outside = [r for r in ranks if r not in parent_comm.world_ranks]
    if outside or not ranks:
        raise ValueError(f"{where(op, rank)}: argument 'ranks' must be a non-empty list "
                         f"of world ranks of the parent {list(parent_comm.world_ranks)}; "
                         f"not members: {outside}")
