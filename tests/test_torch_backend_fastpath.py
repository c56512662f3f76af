"""The torch backend's short path for ``all_reduce`` of one dense tensor (issue 33, small
messages): no detach unless the tensor requires grad, a completed handle made cheaply,
the reduce op looked up by value. Each case against the expected sum over ranks, at any
world size; the handles of blocking and asynchronous calls behave as torch's."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.mpi


def _total(n: int) -> int:
    return n * (n + 1) // 2   # sum of rank + 1 over ranks


def test_leaf_requiring_grad_under_grad_mode(commlib_pg):
    """A parameter-like leaf (requires grad, grad mode on) is reduced in place, as gloo
    does, and keeps requiring grad."""
    r, n = dist.get_rank(), dist.get_world_size()
    p = torch.full((3,), float(r + 1), requires_grad=True)
    assert torch.is_grad_enabled()
    dist.all_reduce(p, group=commlib_pg)
    assert p.requires_grad and p.detach().tolist() == [float(_total(n))] * 3


def test_noncontiguous_and_ops(commlib_pg):
    """A non-contiguous view (result copied back), AVG on floats (short path), AVG on
    integers (truncated, the long path), MAX, complex AVG: each as expected."""
    r, n = dist.get_rank(), dist.get_world_size()
    base = torch.full((4, 3), float(r + 1))
    dist.all_reduce(base[:, 1], group=commlib_pg)
    assert base[:, 1].tolist() == [float(_total(n))] * 4
    assert base[:, 0].tolist() == [float(r + 1)] * 4
    f = torch.full((2,), float(r + 1), dtype=torch.float64)
    dist.all_reduce(f, op=dist.ReduceOp.AVG, group=commlib_pg)
    assert f.tolist() == [_total(n) / n] * 2
    i = torch.full((2,), 2 * r + 1, dtype=torch.int64)
    dist.all_reduce(i, op=dist.ReduceOp.AVG, group=commlib_pg)
    assert i.tolist() == [int(sum(2 * k + 1 for k in range(n)) / n)] * 2
    m = torch.tensor([float(r), -float(r)])
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=commlib_pg)
    assert m.tolist() == [float(n - 1), 0.0]
    c = torch.full((2,), complex(r + 1, -(r + 1)), dtype=torch.complex64)
    dist.all_reduce(c, op=dist.ReduceOp.AVG, group=commlib_pg)
    mean = _total(n) / n
    assert np.allclose(c.numpy(), complex(mean, -mean))


def test_handles_of_blocking_and_async_calls(commlib_pg):
    """The handle of a blocking call is complete, its result and future hold the tensor
    (until the next blocking call on the group: torch's blocking calls drop it at once);
    an asynchronous call's handle completes with the reduced tensor."""
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((2,), float(r + 1))
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    work = commlib_pg.allreduce([t], opts)
    assert work.is_completed() and work.is_success() and work.wait()
    assert work.result()[0] is t and work.get_future().value()[0] is t
    assert work.exception() is None
    assert t.tolist() == [float(_total(n))] * 2
    t2 = torch.full((3,), float(r + 1))     # the next blocking call: its own result, future
    work2 = commlib_pg.allreduce([t2], opts)
    assert work2.wait() and work2.result()[0] is t2 and work2.get_future().value()[0] is t2
    u = torch.full((2,), float(r + 1))
    handle = dist.all_reduce(u, group=commlib_pg, async_op=True)
    assert handle.wait() and u.tolist() == [float(_total(n))] * 2
    assert handle.get_future().wait()[0] is u


def test_list_of_tensors_and_unsupported_op(commlib_pg):
    """More than one tensor takes the long path; an op the backend lacks is refused."""
    r, n = dist.get_rank(), dist.get_world_size()
    a, b = torch.full((2,), float(r + 1)), torch.full((3,), float(r + 1))
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    commlib_pg.allreduce([a, b], opts).wait()
    assert a.tolist() == [float(_total(n))] * 2 and b.tolist() == [float(_total(n))] * 3
    with pytest.raises(NotImplementedError, match="PREMUL_SUM|not supported"):
        dist.all_reduce(a, op=dist._make_nccl_premul_sum(2.0), group=commlib_pg)
