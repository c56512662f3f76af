"""The per-signature caches of the buffer layer (issue 33, small messages): a CPU tensor's
numpy view made once per address, dtype and shape (:mod:`commlib.base.host_views`), and the
dtype lookups of :mod:`commlib.base.buffers`. A cache must never hand MPI a stale view: the
same tensor object whose memory, dtype or shape changed between calls gets a view of what
it is now; conjugate and negative views are refused as ``tensor.numpy()`` refuses them;
non-contiguous tensors still go through a contiguous copy; the cache keeps no tensor
alive. Every test runs at any world size (values checked against the sum over ranks)."""
import gc
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import commlib  # noqa: E402
from commlib.base import buffers, host_views  # noqa: E402


def _n() -> int:
    return commlib.get_world_size()


def _rank_sum(values: np.ndarray) -> np.ndarray:
    """What an allreduce SUM of ``values * (rank + 1)`` gives."""
    n = _n()
    return values * (n * (n + 1) // 2)


def _same_memory(buf: buffers.Buf, t) -> bool:
    return (buf.mem.__array_interface__["data"][0] == t.data_ptr()
            and buf.mem.shape == tuple(t.shape) and buf.count == t.numel())


@pytest.mark.mpi
def test_view_follows_set_resize_and_data():
    """The same tensor object, its memory swapped (``set_``), resized and given another
    dtype (``.data =``) between calls: each call sees the tensor as it is."""
    host_views.clear()
    r = commlib.get_rank() + 1
    t = torch.full((4,), float(r))
    for _ in range(2):                      # the second call is served from the cache
        buf = buffers.adapt(t, "tensor", "allreduce", 0, write=True)
        assert _same_memory(buf, t) and buf.dt.name == "float32"
    commlib.allreduce(t)
    assert t.tolist() == _rank_sum(np.ones(4)).tolist()
    t.set_(torch.full((6,), float(r)))      # new memory, same object
    buf = buffers.adapt(t, "tensor", "allreduce", 0, write=True)
    assert _same_memory(buf, t)
    commlib.allreduce(t)
    assert t.tolist() == _rank_sum(np.ones(6)).tolist()
    t.resize_(3)                            # same address, another shape
    buf = buffers.adapt(t, "tensor", "allreduce", 0, write=True)
    assert _same_memory(buf, t) and buf.shape == (3,)
    t.data = torch.full((3,), r, dtype=torch.int64)   # another dtype
    buf = buffers.adapt(t, "tensor", "allreduce", 0, write=True)
    assert _same_memory(buf, t) and buf.dt.name == "int64"
    commlib.allreduce(t)
    assert t.dtype == torch.int64 and t.tolist() == _rank_sum(np.ones(3, np.int64)).tolist()


@pytest.mark.mpi
def test_view_after_reshape_at_same_address():
    """A view of another shape over the same memory (same address, same dtype) gets a
    view of its own shape (checking mode and errors report the shape)."""
    host_views.clear()
    t = torch.zeros(6)
    buffers.adapt(t, "tensor", "allreduce", 0, write=True)
    v = t.view(2, 3)
    buf = buffers.adapt(v, "tensor", "allreduce", 0, write=True)
    assert buf.shape == (2, 3) and buf.mem.shape == (2, 3)
    b = t.view(torch.int32)                 # same address, another dtype of the same size
    buf = buffers.adapt(b, "tensor", "allreduce", 0, write=True)
    assert buf.dt.name == "int32" and buf.mem.dtype == np.int32


@pytest.mark.mpi
def test_conjugate_and_negative_views_not_served_from_cache():
    """A lazily conjugated or negated view shares the address, dtype and shape of a tensor
    already seen: it is refused as ``tensor.numpy()`` refuses it, never reduced as the
    plain memory."""
    host_views.clear()
    c = torch.ones(4, dtype=torch.complex64)
    commlib.allreduce(c)
    with pytest.raises(RuntimeError, match="conjugate"):
        commlib.allreduce(c.conj())
    x = torch.ones(4)
    commlib.allreduce(x)
    neg = torch._neg_view(x)                # a negative view of the same memory
    assert neg.is_neg() and neg.is_contiguous() and neg.data_ptr() == x.data_ptr()
    with pytest.raises(RuntimeError, match="negative"):
        commlib.allreduce(neg)


@pytest.mark.mpi
def test_noncontiguous_tensor_copied_back():
    """A non-contiguous tensor over memory whose contiguous view is cached still goes
    through a contiguous copy and gets its result copied back."""
    host_views.clear()
    r = commlib.get_rank() + 1
    base = torch.full((4, 4), float(r))
    commlib.allreduce(base[0])              # row 0: contiguous, cached at base's address
    base.fill_(float(r))
    col = base[:, 0]                        # same address as row 0, not contiguous
    assert not col.is_contiguous() and col.data_ptr() == base[0].data_ptr()
    commlib.allreduce(col)
    assert base[:, 0].tolist() == _rank_sum(np.ones(4)).tolist()
    assert base[0, 1:].tolist() == [float(r)] * 3    # the rest of row 0 untouched


@pytest.mark.mpi
def test_cache_keeps_no_tensor_alive_and_memory_reuse():
    """A cached view owns nothing; a new tensor at a freed tensor's address (same dtype
    and shape) is reduced correctly through the view made for the old one."""
    host_views.clear()
    t = torch.ones(1024)
    commlib.allreduce(t)
    gone = weakref.ref(t)
    del t
    gc.collect()
    assert gone() is None
    r = commlib.get_rank() + 1
    for _ in range(20):                     # the allocator often hands the address back
        u = torch.full((1024,), float(r))
        commlib.allreduce(u)
        assert u[0].item() == _rank_sum(np.ones(1))[0] and u[-1].item() == u[0].item()
        del u


@pytest.mark.mpi
def test_numpy_dtype_changed_in_place():
    """A numpy array whose dtype is reassigned between calls (same object, same bytes)
    is reduced as what it is now."""
    r = commlib.get_rank() + 1
    a = np.full(4, r, np.float32)
    commlib.allreduce(a)
    a[...] = r
    a.dtype = np.int32                      # reinterpreted bytes: the sum is an integer sum
    a[...] = r
    commlib.allreduce(a)
    assert a.dtype == np.int32 and a.tolist() == _rank_sum(np.ones(4, np.int64)).tolist()
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        commlib.allreduce(ro)


@pytest.mark.mpi
def test_requires_grad_and_subclass():
    """A tensor requiring grad is refused under grad mode (argument named) and reduced
    under no_grad; a subclass from outside torch is refused as before, torch's own
    (``Parameter``) is reduced through its ``numpy()``."""
    p = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match="'tensor' requires grad"):
        commlib.allreduce(p)
    with torch.no_grad():
        commlib.allreduce(p)
    assert p.tolist() == [float(_n())] * 3

    class Sub(torch.Tensor):
        pass
    s = torch.ones(3).as_subclass(Sub)
    with pytest.raises(TypeError, match="argument 'tensor' must be"):
        commlib.allreduce(s)                # as before the cache: not a torch.* class
    prm = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    commlib.allreduce(prm)                  # a torch.* subclass: through numpy(), uncached
    assert prm.tolist() == [float(_n())] * 3
