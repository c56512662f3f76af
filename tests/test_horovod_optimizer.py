"""hvd.DistributedOptimizer against torch's DistributedDataParallel over gloo, in the same
mpiexec job, float64, after every step, on every rank: equal bit for bit at 1 and 2 ranks
(the same sums), within 1e-10 at 3 and 4 (gloo and MPI add the ranks' gradients in other
orders). Negative control: an optimizer that never synchronizes (the bare torch one) must be
rejected by the same comparison. Also broadcast_parameters / broadcast_optimizer_state
(lazily created state), Horovod's misuse errors and warnings, and algorithm=.
"""
from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import commlib.horovod as hvd  # noqa: E402
from torch_gloo import gloo_world  # noqa: E402

pytestmark = pytest.mark.mpi
STEPS = 4


@pytest.fixture(scope="module", autouse=True)
def horovod(one_thread_per_rank):
    hvd.init()
    yield
    hvd.shutdown()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3)).double()


def batch(step: int, micro: int) -> tuple:
    g = torch.Generator().manual_seed(1000 * hvd.rank() + 10 * step + micro)
    return (torch.randn(5, 6, generator=g, dtype=torch.float64),
            torch.randn(5, 3, generator=g, dtype=torch.float64))


def reference(micro: int, clip: bool, ddp_kwargs: dict) -> list:
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(make_model(), process_group=gloo_world(), **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    history = []
    for s in range(STEPS):
        opt.zero_grad()
        for k in range(micro):
            x, y = batch(s, k)
            if k < micro - 1:
                with model.no_sync():
                    F.mse_loss(model(x), y).backward()
            else:
                F.mse_loss(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def horovod_run(micro: int, clip: bool, broken: bool = False, **kwargs) -> list:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if not broken:   # broken: the bare optimizer never synchronizes, each rank trains alone
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       backward_passes_per_step=micro, **kwargs)
    history = []
    for s in range(STEPS):
        opt.zero_grad()
        for k in range(micro):
            x, y = batch(s, k)
            F.mse_loss(model(x), y).backward()
        if clip and not broken:   # Horovod's recipe for clipping (and AMP)
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def differs(ours: list, ref: list, tol: float) -> str:
    """'' when every step's parameters agree, else what differs first."""
    exact = hvd.size() <= 2 and tol == 0
    for s, (a_step, b_step) in enumerate(zip(ours, ref)):
        for i, (a, b) in enumerate(zip(a_step, b_step)):
            ok = torch.equal(a, b) if exact else torch.allclose(a, b, rtol=tol or 1e-10,
                                                                atol=tol or 1e-12)
            if not ok:
                return f"step {s} parameter {i}: max |diff| {float((a - b).abs().max()):.3e}"
    return ""


def test_distributed_optimizer_matches_torch_ddp():
    n = hvd.size()
    cases = [  # (name, micro, clip, hvd kwargs, tolerance)
        ("default", 1, False, {}, 0),
        ("backward_passes_per_step=2", 2, False, {}, 0),
        ("synchronize+clip+skip_synchronize", 1, True, {}, 0),
        ("gradient_predivide_factor=2", 1, False, {"gradient_predivide_factor": 2.0}, 0),
        ("groups=2", 1, False, {"groups": 2}, 0),
        ("groups=[[last layer]]", 1, False, {"groups": [list(make_model()[4].parameters())]}, 0),
        ("Compression.fp16", 1, False, {"compression": hvd.Compression.fp16}, 2e-3),
        ("algorithm=bytegrad", 1, False, {"algorithm": "bytegrad"}, 2e-2),
    ]
    refs = {}
    failures = []
    for name, micro, clip, kwargs, tol in cases:
        key = (micro, clip)
        if key not in refs:
            refs[key] = reference(micro, clip, {})
        if "groups" in kwargs and isinstance(kwargs["groups"], list):
            continue  # tensors of another model instance: checked by the constructor below
        why = differs(horovod_run(micro, clip, **kwargs), refs[key], tol)
        if why:
            failures.append(f"{name}: {why}")
        if n > 1 and name == "default":
            # negative control: an optimizer that never synchronizes is rejected
            assert differs(horovod_run(1, False, broken=True), refs[key], 0), \
                "the comparison did not reject an optimizer that never synchronizes"
    assert not failures, f"rank {hvd.rank()} of {n}: " + "; ".join(failures)


def test_optimizer_api_and_misuse():
    model = make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD)
    assert set(opt._parameter_names.values()) == {k for k, _ in model.named_parameters()}
    x, y = batch(0, 0)
    F.mse_loss(model(x), y).backward()
    if hvd.size() > 1:
        with pytest.raises(AssertionError, match="zero_grad"):
            opt.zero_grad()
        with pytest.raises(AssertionError, match="backward_passes_per_step"):
            F.mse_loss(model(x), y).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("skip_synchronize" in str(w.message) for w in caught), "no synchronize warning"
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("a", p) for p in model.parameters()])
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=list(model.named_parameters())[:1])
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(base, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(base, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        hvd.DistributedOptimizer(base, algorithm="local_sgd")


def test_broadcast_parameters_and_optimizer_state():
    me = hvd.rank()
    torch.manual_seed(100 + me)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).double()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0))
    assert all(torch.equal(gathered[r], gathered[0]) for r in range(hvd.size())), \
        "broadcast_parameters left different weights"
    makers = [
        ("Adam", lambda ps: torch.optim.Adam(ps, lr=0.01 * (me + 1)), model),
        ("SGD momentum", lambda ps: torch.optim.SGD(ps, lr=0.1 * (me + 1), momentum=0.5),
         model),
        ("Adam wrapped", lambda ps: hvd.DistributedOptimizer(
            torch.optim.Adam(ps, lr=0.01 * (me + 1)), named_parameters=model.named_parameters()),
         model),
    ]
    if hasattr(torch.optim, "Muon"):   # Muon takes 2-D parameters only
        square = nn.Linear(4, 4, bias=False).double()
        hvd.broadcast_parameters(square.state_dict(), root_rank=0)
        makers.append(("Muon", lambda ps: torch.optim.Muon(ps, lr=0.02 * (me + 1)), square))
    for name, make, m in makers:
        opt = make(list(m.parameters()))
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        assert opt.state_dict()["state"], f"{name}: state was not created"
        summary = (opt.param_groups[0]["lr"],
                   sorted((k, float(v.double().sum()) if torch.is_tensor(v) else v)
                          for s in opt.state_dict()["state"].values() for k, v in s.items()))
        everyone = hvd.allgather_object(summary)
        assert all(e == everyone[0] for e in everyone), f"{name}: states differ: {everyone}"
        assert everyone[0][0] == opt.param_groups[0]["lr"]
    with pytest.raises(ValueError, match="LBFGS"):
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), 0)
    os.environ.pop("HOROVOD_ELASTIC", None)


class SparseNet(nn.Module):
    """An Embedding and an EmbeddingBag (sparse gradients when ``sparse``) and a Linear."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(20, 4, sparse=sparse)
        self.bag = nn.EmbeddingBag(20, 4, mode="mean", sparse=sparse)
        self.out = nn.Linear(8, 2)
        self.double()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([self.emb(idx).mean(1), self.bag(idx)], 1))


def sparse_batch(step: int, micro: int) -> tuple:
    g = torch.Generator().manual_seed(500 + 1000 * hvd.rank() + 10 * step + micro)
    return (torch.randint(0, 20, (3, 5), generator=g),   # rows repeat within and across ranks
            torch.randn(3, 2, generator=g, dtype=torch.float64))


def sparse_run(micro: int, mode: str, predivide: float = 1.0) -> list:
    """``mode``: 'sparse' (Horovod's sparse exchange), 'dense' (sparse_as_dense=True),
    'ddp' (torch DDP over gloo, dense embeddings), 'broken' (the sparse exchange skipped:
    each rank applies its own sparse gradient)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = SparseNet(sparse=mode != "ddp")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if mode == "ddp":
        model = DDP(model, process_group=gloo_world())
    else:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       backward_passes_per_step=micro,
                                       sparse_as_dense=mode == "dense",
                                       gradient_predivide_factor=predivide)
        if mode == "broken":
            def skip(p, opt=opt):   # bookkeeping only: no exchange
                bucket, _ = opt._hvd_slots[p]
                opt._hvd_ready.add(p)
                bucket.pending -= 1
            opt._hvd_sparse_launch = skip
    history = []
    for s in range(STEPS):
        opt.zero_grad()
        for k in range(micro):
            x, y = sparse_batch(s, k)
            if mode == "ddp" and k < micro - 1:
                with model.no_sync():
                    F.mse_loss(model(x), y).backward()
            else:
                F.mse_loss(model(x), y).backward()
        if mode == "sparse" and hvd.size() > 1:
            assert model.emb.weight.grad.is_sparse and model.bag.weight.grad.is_sparse
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def test_sparse_gradients_without_sparse_as_dense():
    """Horovod's sparse exchange (allgather of indices and values) for nn.Embedding /
    nn.EmbeddingBag(sparse=True): parameters after every step equal (float64, 1e-12) the
    same training with sparse_as_dense=True and torch DDP over gloo on dense embeddings,
    with backward_passes_per_step 1 and 2 and a predivide factor; skipping the sparse
    exchange is rejected."""
    failures, cases = [], 0
    for micro, predivide in ((1, 1.0), (2, 1.0), (1, 2.0)):
        ddp = sparse_run(micro, "ddp")
        for mode in ("sparse", "dense"):
            why = differs(sparse_run(micro, mode, predivide), ddp, 1e-12)
            if why:
                failures.append(f"{mode} micro={micro} predivide={predivide}: {why}")
            cases += 1
    assert not failures, f"rank {hvd.rank()} of {hvd.size()}: " + "; ".join(failures)
    if hvd.size() > 1:
        assert differs(sparse_run(1, "broken"), sparse_run(1, "ddp"), 1e-12), \
            "the comparison did not reject an optimizer that skips the sparse exchange"
    assert cases == 6
