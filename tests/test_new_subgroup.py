"""Members-only groups: ``commlib.new_subgroup(ranks)`` is called by the ranks in ``ranks``
and nobody else (MPI_Comm_create_group), as torch asks only the members of a new group to
build it."""
import numpy as np
import pytest

import commlib


def _non_contiguous(n: int) -> list[int]:
    """A member list with a gap and out of order: [2, 0] at 3 ranks, [3, 0, 2] at 4."""
    return {1: [0], 2: [1, 0], 3: [2, 0], 4: [3, 0, 2]}.get(n, [n - 1, 0, 2])


@pytest.mark.mpi
def test_members_only_group_of_non_contiguous_ranks():
    rank, n = commlib.get_rank(), commlib.get_world_size()
    members = _non_contiguous(n)
    if rank in members:
        group = commlib.new_subgroup(members)
        assert group.is_member and group.size == len(members)
        assert group.rank == members.index(rank)
        assert list(group.comm.world_ranks) == members
        x = np.array([float(rank), 1.0])
        group.allreduce(x)
        np.testing.assert_array_equal(x, [sum(members), len(members)])
        rows = group.allgather(np.array([rank]))
        np.testing.assert_array_equal(rows[:, 0], members)
        b = np.array([float(rank)])
        group.broadcast(b, src=len(members) - 1)
        assert b[0] == members[-1]
        group.free()
    # Non-members never called anything: the world still lines up afterwards.
    total = commlib.allreduce(np.array([1.0]))
    assert total[0] == n


@pytest.mark.mpi
def test_disjoint_members_only_groups_built_at_the_same_time():
    rank, n = commlib.get_rank(), commlib.get_world_size()
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    mine = evens if rank in evens else odds
    group = commlib.new_subgroup(mine)
    x = np.array([float(rank)])
    group.allreduce(x)
    assert x[0] == sum(mine)
    group.free()


@pytest.mark.mpi
def test_new_subgroup_rejects_bad_ranks():
    rank, n = commlib.get_rank(), commlib.get_world_size()
    with pytest.raises(ValueError, match="duplicates"):
        commlib.new_subgroup([rank, rank])
    with pytest.raises(ValueError, match="not members"):
        commlib.new_subgroup([rank, n + 3])
    if n > 1:
        other = (rank + 1) % n
        with pytest.raises(ValueError, match="only the members call new_subgroup"):
            commlib.new_subgroup([other])
