"""GPU buffers (torch CUDA tensors, cupy arrays): skipped on machines without a GPU, run for
real where one is available. Results must equal the CPU path's; on an MPI library that is
not CUDA-aware they travel through host staging buffers, otherwise straight to MPI."""
import numpy as np
import pytest

import commlib
from commlib import ReduceOp
from commlib.base.accelerator import cuda_usable
from helpers import rank_data

USABLE = cuda_usable()
needs_torch_cuda = pytest.mark.skipif(not USABLE["torch.cuda"], reason="no CUDA GPU for torch")
needs_cupy = pytest.mark.skipif(not USABLE["cupy"], reason="cupy with a GPU is not available")


def expected(numel, seed, n, op=np.sum):
    return op(np.stack([rank_data(r, numel, "float32", seed=seed) for r in range(n)]), axis=0)


@pytest.mark.mpi
@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("async_op", [False, True])
def test_torch_cuda_collectives(dtype, async_op):
    import torch
    rank, n = commlib.get_rank(), commlib.get_world_size()
    numel = 1 << 18
    t = torch.tensor(rank_data(rank, numel, "float32", seed=1), device="cuda",
                     dtype=getattr(torch, dtype))
    work = commlib.allreduce(t, async_op=async_op)
    if async_op:
        work.wait()
    np.testing.assert_allclose(t.float().cpu().numpy(), expected(numel, 1, n), rtol=1e-2)
    g = commlib.allgather(t[:1000])
    assert g.device.type == "cuda" and g.shape == (n, 1000)
    b = torch.full((7,), float(rank), device="cuda")
    commlib.broadcast(b, src=n - 1)
    assert float(b[0]) == n - 1
    rs = commlib.reduce_scatter(torch.ones(10, device="cuda"), op=ReduceOp.AVG)
    assert rs.device.type == "cuda" and torch.all(rs == 1)


@pytest.mark.mpi
@needs_torch_cuda
@pytest.mark.parametrize("path", ["staged", "direct"])
def test_torch_cuda_collectives_on_each_path(path, monkeypatch):
    """Host staging, and straight to MPI where the library is CUDA-aware: same results."""
    import torch

    from commlib.base.accelerator import cuda_aware
    if path == "direct" and not cuda_aware("auto")[0]:
        pytest.skip("the MPI library is not CUDA-aware: GPU buffers are always staged")
    monkeypatch.setattr(commlib.options, "cuda_aware", "0" if path == "staged" else "1")
    rank, n = commlib.get_rank(), commlib.get_world_size()
    numel = 100003
    t = torch.tensor(rank_data(rank, numel, "float32", seed=3), device="cuda")
    commlib.allreduce(t)
    np.testing.assert_array_equal(t.cpu().numpy(), expected(numel, 3, n))
    g = commlib.allgather(t[:999])
    assert g.device.type == "cuda"
    np.testing.assert_array_equal(g.cpu().numpy(), np.stack([expected(numel, 3, n)[:999]] * n))
    a = commlib.alltoall(torch.arange(3 * n, dtype=torch.float64, device="cuda") + 100 * rank)
    assert a.device.type == "cuda"
    want = np.concatenate([np.arange(3 * rank, 3 * rank + 3) + 100 * r for r in range(n)])
    np.testing.assert_array_equal(a.cpu().numpy().ravel(), want)


@pytest.mark.mpi
@needs_cupy
def test_cupy_collectives():
    import cupy
    rank, n = commlib.get_rank(), commlib.get_world_size()
    a = cupy.asarray(rank_data(rank, 4097, "float32", seed=2))
    commlib.allreduce(a)
    np.testing.assert_array_equal(cupy.asnumpy(a), expected(4097, 2, n))
    out = commlib.alltoall(cupy.arange(2 * n, dtype=cupy.float64))
    assert isinstance(out, cupy.ndarray)


@pytest.mark.mpi
@needs_torch_cuda
def test_ddp_on_cuda_matches_cpu():
    import torch

    from models import make
    model = make("mlp", torch.float32).cuda()
    ddp = commlib.DistributedDataParallel(model)
    try:
        x = torch.randn(4, 10, device="cuda")
        ddp(x).sum().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu().numpy()
        everyone = commlib.allgather(grads)
        assert (everyone == everyone[0]).all()
    finally:
        ddp.close()


@pytest.mark.mpi
@needs_torch_cuda
def test_ddp_waits_for_gradients_produced_on_a_side_stream():
    """The forward (hence backward) runs on a side stream whose kernels are slowed by a
    large matmul; the exchange must wait for that stream (an event per gradient), not for
    the communication thread's own stream: gradients must equal a CPU reference exactly."""
    import torch
    import torch.nn.functional as F

    from models import make
    rank, n = commlib.get_rank(), commlib.get_world_size()
    model = make("mlp", torch.float64).cuda()
    ref = make("mlp", torch.float64)
    ddp = commlib.DistributedDataParallel(model, bucket_cap_mb=0.0005,
                                          device_ids=[torch.cuda.current_device()])
    side = torch.cuda.Stream()
    try:
        g = torch.Generator().manual_seed(5)
        x = torch.randn(4 * n, 10, generator=g, dtype=torch.float64)
        y = torch.randint(0, 4, (4 * n,), generator=g)
        mine = slice(4 * rank, 4 * rank + 4)
        with torch.cuda.stream(side):
            busy = torch.randn(4096, 4096, device="cuda")
            for _ in range(8):
                busy = busy @ busy / 4096  # keep the side stream busy before the backward
            F.cross_entropy(ddp(x[mine]), y[mine].cuda()).backward()
        F.cross_entropy(ref(x), y).backward()
        torch.cuda.synchronize()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-10, atol=1e-10)
    finally:
        ddp.close()


# -- every algorithm's DDP on CUDA against the same run on CPU ---------------------------
# Compressed exchanges may differ by one quantization level (the GPU kernels contract a
# multiply and an add into an FMA); async_model_average averages at times set by a clock.
TOLERANCE = {"bytegrad": 1e-3, "qadam": 1e-3, "low_precision_decentralized": 1e-3,
             "async_model_average": 5e-2, "d_kfac": 1e-7, "dp_kfac": 1e-7}
EXTRA_ARGS = {"qadam": {"warmup_steps": 2}, "local_sgd": {"sync_every": 2}}
STEPS = 4


def _algorithms():
    from commlib.algorithms import available
    return available()


def train_on(device: str, name: str, steps: int = STEPS) -> list:
    """``steps`` float64 iterations of the algorithm harness problem on ``device``; the
    flattened weights after each step (on the CPU), this rank's own replica."""
    import torch
    import torch.nn.functional as F

    from algo_harness import BUCKET_MB, batch_indices, digits, model, param_groups
    rank, n = commlib.get_rank(), commlib.get_world_size()
    xs, ys = digits(torch.float64)
    ddp = commlib.DistributedDataParallel(model(torch.float64).to(device), algorithm=name,
                                          bucket_cap_mb=BUCKET_MB,
                                          **EXTRA_ARGS.get(name, {}))
    if name == "qadam":
        from commlib.algorithms.qadam import QAdamOptimizer
        opt = QAdamOptimizer(ddp.parameters(), lr=0.01)
    else:
        opt = torch.optim.SGD(param_groups(ddp.module), lr=0.1, momentum=0.9)
    snapshots = []
    try:
        for step in range(steps):
            idx = batch_indices(rank, n, step)
            opt.zero_grad()
            F.cross_entropy(ddp(xs[idx].to(device)), ys[idx].to(device)).backward()
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()
            snapshots.append(torch.cat([p.detach().reshape(-1).cpu()
                                        for p in ddp.module.parameters()]).numpy().copy())
    finally:
        ddp.close()
    return snapshots


def same_run(cuda_weights: np.ndarray, cpu_weights: np.ndarray, tol: float) -> bool:
    """True when every weight of this rank's CUDA replica is within ``tol`` (absolute and
    relative) of its CPU replica; decided on every rank together."""
    ok = bool(np.allclose(cuda_weights, cpu_weights, rtol=tol, atol=tol))
    return bool(commlib.allreduce(np.array([int(ok)]), op=ReduceOp.MIN)[0])


@pytest.mark.mpi
@needs_torch_cuda
@pytest.mark.parametrize("name", _algorithms())
def test_ddp_every_algorithm_on_cuda_matches_cpu(name):
    import torch
    torch.set_num_threads(1)
    tol = TOLERANCE.get(name, 1e-9)
    cpu = train_on("cpu", name)
    cuda = train_on("cuda", name)
    for step, (a, b) in enumerate(zip(cuda, cpu)):
        assert np.all(np.isfinite(a)), f"{name}: non-finite CUDA weights at step {step}"
        assert same_run(a, b, tol), (f"{name}: CUDA replica differs from the CPU one at "
                                     f"step {step} by {np.abs(a - b).max():.3g} (tol {tol})")
    if tol <= 1e-3:  # negative control: the same check rejects the CPU run a step behind
        assert not same_run(cuda[-1], cpu[-2], tol)
