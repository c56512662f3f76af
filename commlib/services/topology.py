"""Process topologies: the world as a data x pipeline x tensor parallel grid.

:class:`Grid` is the pure arithmetic (no MPI): which world rank sits at which coordinate.
:class:`Topology` builds on it one :class:`commlib.Group` per axis (and per pair of axes)
for this rank, with :func:`commlib.new_subgroup`.

.. not run: a formula, not code

``order`` lists the axes from the fastest varying to the slowest: under the default
``"tp-pp-dp"`` the ranks of a tensor-parallel group are consecutive (they share a node
first, as Megatron-LM places them), then pipeline stages, then data-parallel replicas::

    rank = tp + TP * (pp + PP * dp)
"""
from __future__ import annotations

import socket
import zlib
from collections.abc import Sequence
from itertools import combinations, product
from typing import NamedTuple

AXES = ("dp", "pp", "tp")


class Coord(NamedTuple):
    """A rank's place on the grid."""
    dp: int
    pp: int
    tp: int


def _parse_order(order: str) -> tuple[str, ...]:
    if not isinstance(order, str):
        raise TypeError(f"commlib.Topology: argument 'order' must be a str such as "
                        f"'tp-pp-dp', got {type(order).__name__}")
    names = tuple(order.split("-"))
    if sorted(names) != sorted(AXES):
        raise ValueError(f"commlib.Topology: argument 'order'={order!r} must name each of "
                         f"{'/'.join(AXES)} once, separated by '-' (fastest varying first)")
    return names


class Grid:
    """A ``dp x pp x tp`` grid of ``dp * pp * tp`` ranks (pure arithmetic, no MPI).

    ``order`` names the axes from the fastest varying to the slowest."""

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1, order: str = "tp-pp-dp") -> None:
        sizes = {"dp": dp, "pp": pp, "tp": tp}
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"commlib.Topology: argument {name!r}={value!r} must be a "
                                 f"positive int")
        self.sizes = sizes
        self.order = _parse_order(order)
        self.size = dp * pp * tp

    def rank_of(self, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        """The world rank at a coordinate."""
        coord = {"dp": dp, "pp": pp, "tp": tp}
        rank, stride = 0, 1
        for axis in self.order:
            if not 0 <= coord[axis] < self.sizes[axis]:
                raise ValueError(f"commlib.Topology: coordinate {axis}={coord[axis]} outside "
                                 f"0..{self.sizes[axis] - 1}")
            rank += coord[axis] * stride
            stride *= self.sizes[axis]
        return rank

    def coord_of(self, rank: int) -> Coord:
        """The coordinate of a world rank."""
        if not 0 <= rank < self.size:
            raise ValueError(f"commlib.Topology: rank {rank} outside the grid of {self.size}")
        coord = {}
        for axis in self.order:
            coord[axis] = rank % self.sizes[axis]
            rank //= self.sizes[axis]
        return Coord(**coord)

    def ranks(self, **fixed: int) -> list[int]:
        """World ranks whose coordinates equal ``fixed`` (e.g. ``ranks(pp=0)``), ascending."""
        for axis in fixed:
            if axis not in AXES:
                raise ValueError(f"commlib.Topology.ranks: unknown axis {axis!r}; axes are "
                                 f"{AXES}")
        return [r for r in range(self.size)
                if all(getattr(self.coord_of(r), a) == v for a, v in fixed.items())]

    def members(self, rank: int, *axes: str) -> list[int]:
        """The ranks of ``rank``'s group along ``axes``: those that differ from it only on
        ``axes``, ordered by their coordinates on ``axes`` (last named fastest)."""
        axes = self._check_axes(axes)
        me = self.coord_of(rank)._asdict()
        out = []
        for values in product(*(range(self.sizes[a]) for a in axes)):
            coord = dict(me)
            coord.update(zip(axes, values))
            out.append(self.rank_of(**coord))
        return out

    def groups(self, *axes: str) -> list[list[int]]:
        """The partition of the world into groups along ``axes`` (each as :meth:`members`),
        ordered by their smallest rank."""
        seen, out = set(), []
        for r in range(self.size):
            if r not in seen:
                group = self.members(r, *axes)
                seen.update(group)
                out.append(group)
        return out

    def _check_axes(self, axes: Sequence[str]) -> tuple[str, ...]:
        if not axes or any(a not in AXES for a in axes) or len(set(axes)) != len(axes):
            raise ValueError(f"commlib.Topology: axes {tuple(axes)} must be distinct names "
                             f"among {AXES}")
        return tuple(a for a in AXES if a in axes)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={self.sizes[a]}" for a in AXES)
        return f"<commlib.Grid {sizes} order={'-'.join(self.order)}>"


class Topology(Grid):
    """The world as a ``dp x pp x tp`` grid, with this rank's groups.

    Collective over the world (every rank constructs it with the same arguments).
    ``dp=None`` is the world size divided by ``pp * tp``. ``topo.coord`` is this rank's
    :class:`Coord`; ``topo.group(axis)`` (or ``topo.group("dp", "tp")``) is this rank's
    :class:`commlib.Group` along those axes, whose group ranks follow the coordinates on
    them. The data-parallel group's allreduce is hierarchical by default when its ranks
    span several nodes and some of them share one (nodes as in
    :func:`commlib.get_local_size`, or blocks of ``COMMLIB_LOCAL_SIZE`` ranks).
    """

    def __init__(self, dp: int | None = None, pp: int = 1, tp: int = 1,
                 order: str = "tp-pp-dp") -> None:
        import numpy as np

        from .. import primitives
        from ..base.options import options
        from ..core import runtime
        runtime.init()
        world = runtime.get_world_size()
        rank = runtime.get_rank()
        if dp is None:
            if isinstance(pp, int) and isinstance(tp, int) and pp > 0 and tp > 0 \
                    and world % (pp * tp) == 0:
                dp = world // (pp * tp)
            else:
                raise ValueError(f"commlib.Topology (rank {rank}): pp={pp} x tp={tp} must "
                                 f"divide the world size {world} when dp is not given")
        super().__init__(dp, pp, tp, order)
        if self.size != world:
            raise ValueError(f"commlib.Topology (rank {rank}): dp={dp} x pp={pp} x tp={tp} = "
                             f"{self.size} ranks, but the world has {world}")
        self.rank = rank
        self.coord = self.coord_of(rank)
        k = options.local_size
        node = rank // k if k else zlib.crc32(socket.gethostname().encode())
        self.nodes = [int(v) for v in
                      primitives.allgather(np.array([node], dtype=np.int64))[:, 0]]
        self._groups = {}
        for n in (1, 2):
            for axes in combinations(AXES, n):
                members = self.members(rank, *axes)
                on = [self.nodes[r] for r in members]
                hier = axes == ("dp",) and 1 < len(set(on)) < len(on)
                self._groups[axes] = primitives.group_from_ranks(members, hierarchical=hier)
        self._groups[AXES] = primitives.world()

    def group(self, *axes: str):
        """This rank's :class:`commlib.Group` along ``axes`` (one or several of
        ``"dp"``, ``"pp"``, ``"tp"``; all three: the world)."""
        return self._groups[self._check_axes(axes)]

    def free(self) -> None:
        """Release the groups' communicators (collective over the world)."""
        for axes, group in self._groups.items():
            if axes != AXES:
                group.free()
        self._groups = {}

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]} rank={self.rank} coord={tuple(self.coord)}>"
