"""Bad input raises TypeError/ValueError/CommError naming the argument, on the calling rank,
before any MPI call (so no other rank is left waiting)."""
import numpy as np
import pytest

import commlib
from commlib import ReduceOp

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.mpi


def test_not_a_buffer():
    with pytest.raises(TypeError, match=r"argument 'tensor' must be a numpy.ndarray.*got list"):
        commlib.allreduce([1.0, 2.0])


def test_unsupported_dtype():
    with pytest.raises(TypeError, match="dtype object"):
        commlib.broadcast(np.array([None, 1]))
    with pytest.raises(TypeError, match="dtype"):
        commlib.allreduce(np.array(["a", "b"]))


def test_unknown_op():
    with pytest.raises(ValueError, match="argument 'op' must be one of"):
        commlib.allreduce(np.zeros(2), op="median")
    x = np.ones(2)
    commlib.allreduce(x, op="max")  # names are accepted
    assert x[0] in (1.0,)


def test_avg_on_integers_is_refused():
    with pytest.raises(ValueError, match="AVG needs a floating-point"):
        commlib.allreduce(np.zeros(2, dtype=np.int64), op=ReduceOp.AVG)
    with pytest.raises(ValueError, match="AVG"):
        commlib.reduce_scatter(torch.zeros(2, dtype=torch.int32), op=ReduceOp.AVG)


def test_min_on_complex_is_refused():
    with pytest.raises(ValueError, match="undefined for complex"):
        commlib.allreduce(np.zeros(2, dtype=np.complex128), op=ReduceOp.MIN)


@pytest.mark.parametrize("call", [
    lambda x: commlib.broadcast(x, src=-1),
    lambda x: commlib.reduce(x, dst=10_000),
    lambda x: commlib.send(x, dst=10_000),
    lambda x: commlib.recv(x, src=-2),
])
def test_ranks_out_of_range(call):
    with pytest.raises(ValueError, match="out of range"):
        call(np.zeros(2))


def test_rank_must_be_int():
    with pytest.raises(TypeError, match="argument 'src' must be an int"):
        commlib.broadcast(np.zeros(2), src=0.0)


def test_negative_tag():
    with pytest.raises(ValueError, match="argument 'tag'=-1"):
        commlib.send(np.zeros(2), dst=0, tag=-1)


def test_requires_grad_modified_in_place():
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="requires grad"):
        commlib.allreduce(p)
    with torch.no_grad():
        commlib.allreduce(p)  # allowed, as torch allows in-place updates under no_grad
    commlib.allgather(p)      # read-only use is fine


def test_read_only_array():
    x = np.zeros(3)
    x.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        commlib.allreduce(x)


def test_alltoall_leading_dim():
    n = commlib.get_world_size()
    with pytest.raises(ValueError, match="divisible by the group size"):
        commlib.alltoall(np.zeros(()))
    if n > 1:
        with pytest.raises(ValueError, match="divisible"):
            commlib.alltoall(np.zeros(n + 1))


def test_bad_group():
    with pytest.raises(TypeError, match="argument 'group'"):
        commlib.allreduce(np.zeros(2), group="world")


def test_allgather_v_scalar():
    with pytest.raises(ValueError, match="at least one dimension"):
        commlib.allgather_v(np.float64(1.0).reshape(()))


def test_recv_shorter_message_is_an_error():
    if commlib.get_world_size() != 1:
        pytest.skip("self-message test for a single rank")
    commlib.send(np.arange(3.0), dst=0, tag=9, async_op=True)
    with pytest.raises(commlib.CommError, match="sent 3 elements.*holds 5"):
        commlib.recv(np.zeros(5), src=0, tag=9)
