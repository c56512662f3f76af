"""comm_dtype and predivide_factor of the gradient-averaging algorithms, and the torch-style
compression hooks (commlib.ddp.comm_hooks): the arithmetic at 64 simulated ranks (float16 finite
where dividing after the sum overflows), bytes exactly halved for float32 models, and
agreement with torch DDP and torch's fp16 hooks over gloo."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import commlib  # noqa: E402
from commlib.algorithms import precision  # noqa: E402
from torch_gloo import gloo_world  # noqa: E402

TorchDDP = torch.nn.parallel.DistributedDataParallel


# -- the arithmetic, ranks simulated --------------------------------------------------------

def simulate(grads, comm_dtype, factor):
    """Every simulated rank's result: prepare, a sum rounded to ``comm_dtype`` after each
    addition (as MPI's reductions combine pairs), finish."""
    sends = [precision.prepare(g.clone(), comm_dtype, factor) for g in grads]
    total = sends[0].clone()
    for s in sends[1:]:
        total = total + s  # torch rounds each half-precision addition
    return [precision.finish(g.clone(), total, len(grads), factor) for g in grads]


def agrees(results, grads, factor, rtol):
    """Every rank holds sum(g / f) * f / n (float64 reference) to ``rtol`` of the largest
    value, and nothing is inf or nan."""
    g64 = np.stack([g.double().numpy() for g in grads])
    ref = (g64 / factor).sum(0) * factor / len(grads)
    scale = np.abs(ref).max()
    return all(torch.isfinite(r).all() and np.abs(r.double().numpy() - ref).max() <= rtol * scale
               for r in results)


def rank_grads(n, low, high, numel=257, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(numel, generator=g) * (high - low) + low) for _ in range(n)]


@pytest.mark.parametrize("factor", [1.0, 3.0, 64.0])
def test_float32_semantics_are_sum_of_predivided_times_f_over_n(factor):
    grads = rank_grads(64, -1.0, 1.0)
    out = simulate(grads, None, factor)
    exact = (torch.stack([g / factor for g in grads]).sum(0) * factor / 64)
    assert all(torch.allclose(o, exact, rtol=1e-6, atol=1e-6) for o in out)
    assert agrees(out, grads, factor, 1e-6)


# 64 float16 additions, each rounded (half an ulp, 2**-12 relative): the sum is within
# about sqrt(64) such roundings; measured 2.8e-3 (large, predivided), 2.6e-3 (small, divided
# after) and 2.5e-2 (small, predivided by 64: they fall into float16 subnormals).
FP16_SUM_RTOL = 8 * 2.0 ** -11


def test_float16_at_64_ranks_predivision_keeps_large_sums_finite():
    grads = rank_grads(64, 1000.0, 2000.0)  # the sum (~1e5) exceeds float16's 65504
    assert agrees(simulate(grads, torch.float16, 64.0), grads, 64.0, FP16_SUM_RTOL)
    assert agrees(simulate(grads, torch.float16, 8.0), grads, 8.0, FP16_SUM_RTOL)
    # negative control: dividing after the sum overflows, and the checker says so
    post = simulate(grads, torch.float16, 1.0)
    assert not torch.isfinite(post[0]).all() and not agrees(post, grads, 1.0, FP16_SUM_RTOL)


def test_float16_at_64_ranks_postdivision_keeps_small_gradients():
    grads = rank_grads(64, 1e-5, 2e-5)  # divided by 64 first, they lose most of their bits
    assert agrees(simulate(grads, torch.float16, 1.0), grads, 1.0, FP16_SUM_RTOL)
    assert not agrees(simulate(grads, torch.float16, 64.0), grads, 64.0, FP16_SUM_RTOL)


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="comm_dtype"):
        commlib.algorithms.get("gradient_allreduce", comm_dtype=torch.int8)
    with pytest.raises(ValueError, match="comm_dtype"):
        commlib.algorithms.get("gradient_allreduce", comm_dtype="fp8")
    with pytest.raises(ValueError, match="predivide_factor"):
        commlib.algorithms.get("gradient_allreduce", predivide_factor=0)
    with pytest.raises(ValueError, match="average=True"):
        commlib.algorithms.get("gradient_allreduce", predivide_factor=2, average=False)
    with pytest.raises(TypeError, match="predivide_factor"):
        commlib.algorithms.get("bytegrad", predivide_factor=2)


# -- under DDP ----------------------------------------------------------------------------

def net(dtype=torch.float32):
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 3)).to(dtype)


def batch(step, per_rank=3, dtype=torch.float32):
    n, rank = commlib.get_world_size(), commlib.get_rank()
    g = torch.Generator().manual_seed(1000 * step + 17)
    x = torch.randn(n * per_rank, 5, generator=g).to(dtype)
    y = torch.randint(0, 3, (n * per_rank,), generator=g)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[mine], y[mine]


def train(model, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(step, dtype=next(model.parameters()).dtype)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    inner = model.module if hasattr(model, "module") else model
    return [p.detach().double().clone() for p in inner.parameters()]


def backward_bytes(make_ddp, hook=None):
    ddp = make_ddp()
    try:
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        commlib.stats(reset=True)
        x, y = batch(0)
        F.cross_entropy(ddp(x), y).backward()
        return commlib.stats(reset=True)["allreduce"]["bytes"]
    finally:
        ddp.close()


@pytest.fixture(scope="module")
def gloo():
    return gloo_world()


@pytest.mark.mpi
def test_half_precision_exchange_halves_the_bytes(one_thread_per_rank):
    from commlib.ddp import comm_hooks as hooks
    numel = sum(p.numel() for p in net().parameters())
    D = commlib.DistributedDataParallel
    full = backward_bytes(lambda: D(net(), bucket_cap_mb=0.0002))
    assert full == 4 * numel
    for kw in ({"comm_dtype": torch.bfloat16}, {"comm_dtype": "fp16", "predivide_factor": 2}):
        assert backward_bytes(lambda: D(net(), bucket_cap_mb=0.0002, **kw)) == full // 2, kw
    # qadam's warm-up exchange
    assert backward_bytes(lambda: D(net(), bucket_cap_mb=0.0002, algorithm="qadam",
                                    comm_dtype=torch.bfloat16)) == full // 2
    # K-FAC's gradient exchange (its factor exchange is unchanged: the difference is half
    # the gradients' bytes)
    for algorithm in ("d_kfac", "dp_kfac"):
        kfac = [backward_bytes(lambda: D(net(), bucket_cap_mb=0.0002, algorithm=algorithm,
                                         **kw)) for kw in ({}, {"comm_dtype": "bf16"})]
        assert kfac[0] - kfac[1] == full // 2, algorithm
    for hook in (hooks.fp16_compress_hook, hooks.bf16_compress_hook,
                 hooks.fp16_compress_wrapper(hooks.allreduce_hook)):
        assert backward_bytes(lambda: D(net(), bucket_cap_mb=0.0002), hook) == full // 2


@pytest.mark.mpi
@pytest.mark.parametrize("variant", ["comm_dtype", "commlib_wrapper", "torch_wrapper",
                                     "not_averaged"])
def test_fp16_exchange_against_torch_ddp_with_fp16_compress_hook(gloo, one_thread_per_rank,
                                                                 variant):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from commlib.ddp import comm_hooks as hooks
    n = commlib.get_world_size()
    oracle = TorchDDP(net(), bucket_cap_mb=0.0002)
    oracle.register_comm_hook(None, default_hooks.fp16_compress_hook)
    theirs = train(oracle)
    kw = {"comm_dtype": torch.float16, "predivide_factor": n}
    if variant == "not_averaged":
        kw = {"comm_dtype": torch.float16, "average": False}  # negative control: n x too big
    ddp = commlib.DistributedDataParallel(net(), bucket_cap_mb=0.0002,
                                          **({} if variant.endswith("wrapper") else kw))
    try:
        if variant == "commlib_wrapper":
            ddp.register_comm_hook(None, hooks.fp16_compress_wrapper(hooks.allreduce_hook))
        elif variant == "torch_wrapper":  # torch's wrapper around commlib's hook
            ddp.register_comm_hook(None, default_hooks.fp16_compress_wrapper(
                hooks.allreduce_hook))
        ours = train(ddp)
    finally:
        ddp.close()
    close = all(torch.allclose(a, b, rtol=1e-3, atol=1e-3) for a, b in zip(ours, theirs))
    mine = torch.cat([p.reshape(-1) for p in ours]).numpy()
    assert all(np.array_equal(o, mine) for o in commlib.allgather(mine))
    if variant == "not_averaged" and n > 1:
        assert not close
    else:
        assert close


@pytest.mark.mpi
@pytest.mark.parametrize("factor", [1.0, 2.0, 3.0])
def test_float64_predivide_matches_torch_ddp(gloo, one_thread_per_rank, factor):
    theirs = train(TorchDDP(net(torch.float64), bucket_cap_mb=0.0002))
    ddp = commlib.DistributedDataParallel(net(torch.float64), bucket_cap_mb=0.0002,
                                          predivide_factor=factor)
    try:
        ours = train(ddp)
    finally:
        ddp.close()
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-10) for a, b in zip(ours, theirs))
