"""Process topologies: grid arithmetic (no MPI) and this rank's groups (multi-rank)."""
import itertools

import numpy as np
import pytest

import commlib
from commlib.services.topology import AXES, Grid

SHAPES = [(1, 1, 1), (2, 1, 1), (1, 4, 1), (2, 2, 1), (2, 1, 3), (3, 2, 2), (2, 3, 4)]
ORDERS = ["tp-pp-dp", "dp-pp-tp", "pp-tp-dp"]


def brute_groups(grid, axes):
    """The partition along ``axes`` by brute force: ranks equal on every other axis."""
    other = [a for a in AXES if a not in axes]
    key = {r: tuple(getattr(grid.coord_of(r), a) for a in other) for r in range(grid.size)}
    out = {}
    for r in range(grid.size):
        out.setdefault(key[r], []).append(r)
    return sorted(sorted(g) for g in out.values())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("order", ORDERS)
def test_grid_membership(shape, order):
    dp, pp, tp = shape
    grid = Grid(dp=dp, pp=pp, tp=tp, order=order)
    assert grid.size == dp * pp * tp
    coords = [grid.coord_of(r) for r in range(grid.size)]
    assert len(set(coords)) == grid.size  # a bijection
    for r, c in enumerate(coords):
        assert grid.rank_of(**c._asdict()) == r
    # the fastest axis of `order` changes between consecutive ranks
    fast = order.split("-")[0]
    if grid.sizes[fast] > 1:
        assert getattr(coords[1], fast) == 1
    for n in (1, 2, 3):
        for axes in itertools.combinations(AXES, n):
            groups = grid.groups(*axes)
            assert sorted(sorted(g) for g in groups) == brute_groups(grid, axes)
            size = int(np.prod([grid.sizes[a] for a in axes]))
            for g in groups:
                assert len(g) == size
                # group rank i sits at coordinate i (row-major over `axes`)
                for i, r in enumerate(g):
                    c = grid.coord_of(r)
                    flat = 0
                    for a in axes:
                        flat = flat * grid.sizes[a] + getattr(c, a)
                    assert flat == i
    for axis in AXES:
        for v in range(grid.sizes[axis]):
            assert grid.ranks(**{axis: v}) == [r for r in range(grid.size)
                                              if getattr(coords[r], axis) == v]


def test_default_order_is_tp_fastest():
    grid = Grid(dp=2, pp=2, tp=2)
    assert grid.members(0, "tp") == [0, 1]
    assert grid.members(0, "pp") == [0, 2]
    assert grid.members(0, "dp") == [0, 4]
    assert grid.ranks(pp=1, tp=0) == [2, 6]


def test_grid_bad_input():
    with pytest.raises(ValueError, match="'pp'"):
        Grid(pp=0)
    with pytest.raises(ValueError, match="order"):
        Grid(order="tp-dp")
    with pytest.raises(TypeError, match="order"):
        Grid(order=3)
    with pytest.raises(ValueError, match="axis"):
        Grid(dp=2).ranks(xp=0)
    # negative control of the checker: a wrong partition is told apart
    grid = Grid(dp=2, tp=2)
    assert brute_groups(grid, ("dp",)) != [[0, 1], [2, 3]]


@pytest.mark.mpi
@pytest.mark.parametrize("pp,tp", [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (1, 3), (4, 1)])
def test_topology_groups(pp, tp):
    n = commlib.get_world_size()
    if n % (pp * tp):
        with pytest.raises(ValueError, match="divide"):
            commlib.Topology(pp=pp, tp=tp)
        return
    topo = commlib.Topology(pp=pp, tp=tp)
    rank = commlib.get_rank()
    assert topo.coord == topo.coord_of(rank)
    assert topo.sizes["dp"] == n // (pp * tp)
    for axes in [("dp",), ("pp",), ("tp",), ("dp", "tp"), ("pp", "tp"), ("dp", "pp")]:
        group = topo.group(*axes)
        members = topo.members(rank, *axes)
        assert list(group.ranks) == members
        assert group.rank == members.index(rank)
        # every member sees the same membership: gather world ranks over the group
        got = group.allgather(np.array([rank]))[:, 0]
        np.testing.assert_array_equal(got, members)
    assert topo.group("dp", "pp", "tp").size == n
    topo.free()
    commlib.barrier()


@pytest.mark.mpi
def test_topology_hierarchical_dp(monkeypatch):
    n = commlib.get_world_size()
    if n < 4:
        pytest.skip("needs 2 nodes of 2 ranks")
    monkeypatch.setattr(commlib.options, "local_size", 2)
    flat = commlib.Topology(tp=2)          # dp pairs (0, 2): one rank per node
    assert not flat.group("dp").hierarchical
    hier = commlib.Topology()              # dp = the world: 2 nodes of 2
    assert hier.group("dp").hierarchical
    assert not hier.group("tp").hierarchical
    flat.free()
    hier.free()
