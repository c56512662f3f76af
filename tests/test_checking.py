"""Checking mode: ranks that disagree about a collective all raise CommError, no hang."""
import numpy as np
import pytest

import commlib
from commlib import ReduceOp


@pytest.fixture
def checking(monkeypatch):
    monkeypatch.setattr(commlib.options, "check", True)


def expect_mismatch(call, *fragments):
    with pytest.raises(commlib.CommError) as info:
        call()
    text = str(info.value)
    for fragment in fragments:
        assert fragment in text
    return text


@pytest.mark.mpi(min_size=2)
def test_mismatched_shapes_raise_on_every_rank(checking):
    rank = commlib.get_rank()
    x = np.zeros(4 if rank == 0 else 5)
    text = expect_mismatch(lambda: commlib.allreduce(x), "ranks [0] called allreduce",
                           "shape=(4,)", "shape=(5,)")
    assert f"rank {rank}" in text
    commlib.allreduce(np.zeros(3))  # the group is still usable afterwards


@pytest.mark.mpi(min_size=2)
def test_mismatched_dtypes_raise(checking):
    x = np.zeros(4, dtype=np.float32 if commlib.get_rank() == 0 else np.float64)
    expect_mismatch(lambda: commlib.broadcast(x), "float32", "float64")


@pytest.mark.mpi(min_size=2)
def test_mismatched_ops_raise(checking):
    op = ReduceOp.SUM if commlib.get_rank() == 0 else ReduceOp.MAX
    expect_mismatch(lambda: commlib.allreduce(np.zeros(2), op=op), "op=SUM", "op=MAX")


@pytest.mark.mpi(min_size=2)
def test_different_collectives_raise(checking):
    x = np.zeros(3)
    call = commlib.allgather if commlib.get_rank() == 0 else commlib.reduce_scatter
    expect_mismatch(lambda: call(x), "called allgather", "called reduce_scatter")


@pytest.mark.mpi(min_size=2)
def test_mismatched_roots_raise(checking):
    src = 0 if commlib.get_rank() == 0 else 1
    expect_mismatch(lambda: commlib.broadcast(np.zeros(2), src=src), "src=0", "src=1")


@pytest.mark.mpi
def test_matching_calls_pass(checking):
    x = np.ones(3)
    commlib.allreduce(x)
    np.testing.assert_array_equal(x, commlib.get_world_size())


@pytest.mark.mpi(min_size=2)
def test_allgather_v_always_checks_trailing_shape():
    x = np.zeros((2, 3 if commlib.get_rank() == 0 else 4))
    expect_mismatch(lambda: commlib.allgather_v(x), "all dimensions but the first")
