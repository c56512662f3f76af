"""``muloco`` (MuLoCo, arXiv 2505.23725): DiLoCo with compressed pseudo-gradients and a
per-rank error-feedback accumulator.

(a) against the update rule written here with torch alone in float64 (inner steps, the
pseudo-gradient, the decayed accumulator, each compression written from its definition,
the decoded messages averaged through ``commlib.allgather`` in rank order, the outer
Nesterov SGD), every rank's replica after every step; (b) the bytes of every outer step
against the formula, and the ratio to DiLoCo's; (c) convergence of every replica with
the Muon inner optimizer, negative controls (no error feedback under top-k 5%, never
communicating) rejected; (d) bit-exact resume; (e) bfloat16 weights; (f) bad arguments.
"""
import io
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")
import torch.nn.functional as F  # noqa: E402

import commlib  # noqa: E402
from algo_harness import (  # noqa: E402
    BUCKET_MB,
    batch_indices,
    bus_bytes,
    digits,
    model,
    param_groups,
    same_everywhere,
    train,
)
from commlib.algorithms.muloco import MuLoCo, MuonWithAdamW, muloco_inner_optimizer  # noqa: E402
from commlib.base.reduce_ops import ReduceOp  # noqa: E402
from commlib.ddp import per_rank_state  # noqa: E402
from commlib.primitives import allreduce  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")

STEPS = 8
CHUNK = 2048


def inner(kind, module):
    if kind == "adam":
        return torch.optim.Adam(param_groups(module), lr=0.01)
    if kind == "muon":
        return muloco_inner_optimizer(module, lr=0.05, adamw_lr=0.01)
    return torch.optim.SGD(param_groups(module), lr=0.1, momentum=0.9)


def flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


# -- the compressions, from their definitions: float64 vector in, float32 decoded out ---
def int2_reference(x):
    """The paper's 2-bit statistical quantizer of one tensor."""
    x = x.double()
    if not torch.isfinite(x).all():
        return torch.full(x.shape, float("nan"), dtype=torch.float32)
    shift = x.mean().float()
    c = x - shift.double()
    sigma = c.std(unbiased=True) if x.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
    width = 6.0 * sigma / 4
    if not (width > 0 and torch.isfinite(width)):
        width = torch.tensor(1.0, dtype=torch.float64)
    bins = torch.clamp(torch.round(c / width + 2), 0, 3)
    out = torch.empty(x.shape, dtype=torch.float32)
    for b in range(4):
        members = bins == b
        if members.any():
            out[members] = c[members].sum().div(members.sum()).float() + shift
    return out


def topk_reference(x, ratio):
    k = max(1, int(ratio * x.numel()))
    keep = torch.topk(x.abs(), k).indices
    out = torch.zeros(x.shape, dtype=torch.float32)
    out[keep] = x[keep].float()
    return out


def minmax_reference(x, levels):
    """Min-max codes of ``levels`` + 1 values per chunk of 2048, float32 arithmetic as
    commlib.kernels documents it (uint8: levels 255; int4: 15)."""
    x = x.float()
    out = torch.empty_like(x)
    f = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    for s in range(0, x.numel(), CHUNK):
        c = x[s:s + CHUNK]
        lo, hi = c.min() + f(0.0), c.max() + f(0.0)
        rng = hi - lo
        pre = f(2.0 ** 64) if rng < f(2.0 ** -64) else f(1.0)
        if rng == 0:
            q = torch.zeros_like(c)
        else:
            q = torch.round(((c - lo) * pre) * (f(float(levels)) / (rng * pre)))
        if levels == 255:
            out[s:s + CHUNK] = torch.minimum(lo + (q * f(1.0 / 255.0)) * rng, hi)
        else:
            out[s:s + CHUNK] = torch.minimum(lo + q * (rng / f(15.0)), hi)
    return out


def decoded_reference(kind, vector, sizes, ratio):
    if kind in ("int2", "topk"):
        parts, at = [], 0
        for n in sizes:
            piece = vector[at:at + n]
            parts.append(int2_reference(piece) if kind == "int2" else
                         topk_reference(piece, ratio))
            at += n
        return torch.cat(parts)
    return minmax_reference(vector, 255 if kind == "int8" else 15)


def reference_run(cfg, layout):
    """The MuLoCo step written with torch: the weights after each step. ``layout``: the
    parameter names of each bucket (the configuration the messages are cut along)."""
    rank, n = commlib.get_rank(), commlib.get_world_size()
    x, y = digits(torch.float64)
    module = model(torch.float64)
    named = dict(module.named_parameters())
    opt = inner(cfg["inner"], module)
    original = {k: p.detach().clone() for k, p in named.items()}
    outer = torch.optim.SGD(module.parameters(), lr=cfg["outer_lr"],
                            momentum=cfg["outer_momentum"], nesterov=True)
    acc = [None] * len(layout)
    out = []
    for step in range(STEPS):
        idx = batch_indices(rank, n, step)
        opt.zero_grad()
        F.cross_entropy(module(x[idx]), y[idx]).backward()
        opt.step()
        if (step + 1) % cfg["sync_every"] == 0:
            with torch.no_grad():
                grads = {}
                for k, names in enumerate(layout):
                    delta = torch.cat([(original[m] - named[m]).reshape(-1) for m in names])
                    if cfg["error_feedback"] and acc[k] is not None:
                        e = cfg["error_decay"] * acc[k] + delta
                    else:
                        e = delta
                    mine = decoded_reference(cfg["compression"], e,
                                             [named[m].numel() for m in names],
                                             cfg.get("topk_ratio", 0.02))
                    everyone = commlib.allgather(mine)
                    total = everyone[0].double().clone()
                    for r in range(1, n):
                        total = total + everyone[r].double()
                    avg = total / n
                    if cfg["error_feedback"]:
                        acc[k] = e - mine.double()
                    at = 0
                    for m in names:
                        grads[m] = avg[at:at + named[m].numel()].view_as(named[m])
                        at += named[m].numel()
                for m, p in named.items():
                    p.copy_(original[m])
                    p.grad = grads[m].clone()
            outer.step()
            outer.zero_grad()
            original = {k: p.detach().clone() for k, p in named.items()}
        out.append(flat(module))
    return out


def our_run(cfg):
    """Ours: the weights before each forward (the outer step runs there) after a last
    settling forward; and the bucket layout."""
    rank, n = commlib.get_rank(), commlib.get_world_size()
    x, y = digits(torch.float64)
    module = model(torch.float64)
    kwargs = {k: v for k, v in cfg.items() if k != "inner"}
    ddp = commlib.DistributedDataParallel(module, algorithm=MuLoCo(**kwargs),
                                          bucket_cap_mb=BUCKET_MB)
    assert len(ddp._ctx.buckets) >= 3
    layout = [list(b.names) for b in ddp._ctx.buckets]
    opt = inner(cfg["inner"], module)
    out = []
    handle = module.register_forward_pre_hook(lambda *_: out.append(flat(module)))
    try:
        for step in range(STEPS):
            idx = batch_indices(rank, n, step)
            opt.zero_grad()
            F.cross_entropy(ddp(x[idx]), y[idx]).backward()
            opt.step()
        with torch.enable_grad():
            ddp(x[:1])
    finally:
        handle.remove()
        ddp.close()
    return out[1:], layout


def gap(a, b) -> float:
    g = max(float((u - v).abs().max()) for u, v in zip(a, b))
    return float(allreduce(torch.tensor([g]), op=ReduceOp.MAX))


BASE = dict(outer_lr=0.7, outer_momentum=0.6, error_feedback=True, error_decay=0.9)
CASES = [
    dict(BASE, sync_every=2, compression="int2", inner="sgd"),
    dict(BASE, sync_every=3, compression="topk", topk_ratio=0.1, inner="adam"),
    dict(BASE, sync_every=2, compression="int8", error_decay=1.0, inner="sgd"),
    dict(BASE, sync_every=2, compression="int4", inner="adam"),
    dict(BASE, sync_every=2, compression="int2", error_feedback=False, outer_lr=1.1,
         outer_momentum=0.8, inner="sgd"),
    dict(BASE, sync_every=2, compression="int2", inner="muon"),
]


@pytest.mark.mpi
def test_muloco_matches_the_torch_formulation_after_every_step():
    """Every compression, with and without error feedback, decayed or not, SGD, Adam and
    Muon inside, 8 steps, every rank's own replica; negative controls: the reference
    without the decay, and without error feedback, differ from ours."""
    n = commlib.get_world_size()
    first = None
    for k, cfg in enumerate(CASES):
        ours, layout = our_run(cfg)
        first = first or (ours, layout)
        d = gap(ours, reference_run(cfg, layout))
        print(f"muloco vs torch formulation, case {k} ({cfg['compression']}, "
              f"{cfg['inner']}): largest difference {d:.3g}")
        assert d <= 1e-10, f"case {k} {cfg}: differs from the torch formulation by {d:.3g}"
        if n > 1:
            assert not same_everywhere([ours[0]])
            assert same_everywhere([ours[cfg["sync_every"] - 1]])
    ours, layout = first
    assert gap(ours, reference_run(dict(CASES[0], error_decay=1.0), layout)) > 1e-6
    assert gap(ours, reference_run(dict(CASES[0], error_feedback=False), layout)) > 1e-6


def message_bytes(kind, numels, ratio=0.02):
    """One rank's message for a bucket holding tensors of ``numels`` elements."""
    length = sum(numels)
    chunks = math.ceil(length / CHUNK)
    if kind == "int2":
        return sum(20 + math.ceil(m / 4) for m in numels)
    if kind == "topk":
        return 8 * sum(max(1, int(ratio * m)) for m in numels)
    if kind == "int8":
        return 8 * math.ceil((32 + 8 * chunks + length) / 8)
    return chunks * (8 + CHUNK // 2)


@pytest.mark.mpi
def test_bytes_per_outer_step_are_the_formula():
    """12 iterations, H = 4: the outer steps after iterations 4 and 8 are counted (the one
    after 12 runs at the settling forward, after the counters were read). Each is one
    allgather per bucket of ``M_b`` bytes: ``bytes = sum M_b``, ``bus_bytes = (n - 1) sum
    M_b``; DiLoCo's is a float32 allreduce: ``2 (n - 1) / n * 4 L_b`` per bucket."""
    n = commlib.get_world_size()
    diloco = train("diloco", steps=12, sync_every=4)
    sizes = [b.numels for b in diloco["ddp"]._ctx.buckets]
    per_diloco = sum(2 * (n - 1) * 4 * sum(s) // n for s in sizes)
    assert bus_bytes(diloco["stats"]) == 2 * per_diloco
    for kind in ("int2", "topk", "int8", "int4"):
        out = train(MuLoCo(sync_every=4, compression=kind, topk_ratio=0.05), steps=12)
        assert [b.numels for b in out["ddp"]._ctx.buckets] == sizes
        per_step = sum(message_bytes(kind, s, 0.05) for s in sizes)
        gathered = out["stats"]["allgather"]
        assert set(out["stats"]) == {"allgather"}, out["stats"].keys()
        assert gathered["calls"] == 2 * len(sizes)
        assert gathered["bytes"] == 2 * per_step
        assert bus_bytes(out["stats"]) == 2 * (n - 1) * per_step
        if n > 1:
            ratio = bus_bytes(out["stats"]) / bus_bytes(diloco["stats"])
            print(f"muloco {kind}: {per_step} bytes per rank per outer step "
                  f"(bus {(n - 1) * per_step}), diloco bus {per_diloco}: ratio {ratio:.4f}")
            assert ratio == pytest.approx((n - 1) * per_step / per_diloco, rel=1e-12)
            assert ratio < 1


class Silent(MuLoCo):
    """Negative control: never communicates (every replica trains alone)."""

    def _sync(self, ctx):
        pass


_ref = {}


@pytest.mark.mpi
def test_muloco_with_muon_converges_on_every_replica():
    """Muon inside (the paper's inner optimizer), H = 4, 60 iterations: every replica's
    loss within 1.5x (+0.02) of gradient_allreduce's with the 2-bit quantizer and with
    top-k 5%; rejected: top-k 5% without error feedback, and never communicating."""
    n = commlib.get_world_size()
    if not _ref:
        _ref.update(train("gradient_allreduce", steps=60))
    opt = lambda ddp: muloco_inner_optimizer(ddp.module, lr=0.1, adamw_lr=0.01)  # noqa: E731

    def check(out):
        assert out["loss"] <= _ref["loss"] * 1.5 + 0.02, (out["losses"], _ref["loss"])

    int2 = train(MuLoCo(sync_every=4), steps=60, optimizer=opt)
    topk = train(MuLoCo(sync_every=4, compression="topk", topk_ratio=0.05), steps=60,
                 optimizer=opt)
    print(f"gradient_allreduce {_ref['loss']:.3f}, muloco int2 {int2['loss']:.3f}, "
          f"muloco topk 5% {topk['loss']:.3f}")
    check(int2)
    check(topk)
    if n > 1:
        no_ef = train(MuLoCo(sync_every=4, compression="topk", topk_ratio=0.05,
                             error_feedback=False), steps=60, optimizer=opt)
        alone = train(Silent(sync_every=4), steps=60, optimizer=opt)
        print(f"controls: topk 5% without error feedback {no_ef['loss']:.3f}, never "
              f"communicating {alone['loss']:.3f}")
        for control in (no_ef, alone):
            with pytest.raises(AssertionError):
                check(control)


def run_steps(ddp, opt, first, last):
    rank, n = commlib.get_rank(), commlib.get_world_size()
    x, y = digits()
    for step in range(first, last):
        idx = batch_indices(rank, n, step)
        opt.zero_grad()
        F.cross_entropy(ddp(x[idx]), y[idx]).backward()
        opt.step()


def build(kwargs):
    ddp = commlib.DistributedDataParallel(model(), algorithm=MuLoCo(**kwargs),
                                          bucket_cap_mb=BUCKET_MB)
    return ddp, muloco_inner_optimizer(ddp.module, lr=0.05, adamw_lr=0.01)


def final(ddp, opt):
    return ([p.detach().clone() for p in ddp.module.parameters()], ddp.algorithm.state_dict(),
            opt.state_dict())


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(u, v) for u, v in zip(a, b))
    return a == b


@pytest.mark.mpi
@pytest.mark.parametrize("kwargs", [dict(sync_every=3, compression="int2"),
                                    dict(sync_every=2, compression="topk", topk_ratio=0.1,
                                         error_decay=1.0)])
def test_resume_is_bit_exact(kwargs):
    """Saved after 4 iterations (accumulators and outer momentum set; with H = 3 mid-period,
    with H = 2 an outer step due), restored into fresh wrappers and trained 4 more: bitwise
    the uninterrupted run (weights, algorithm state, Muon/AdamW state). Negative control:
    restoring model and optimizer only differs. Another rank's state is refused."""
    n, rank = commlib.get_world_size(), commlib.get_rank()
    ddp, opt = build(kwargs)
    try:
        run_steps(ddp, opt, 0, 8)
        full = final(ddp, opt)
    finally:
        ddp.close()
    ddp, opt = build(kwargs)
    try:
        run_steps(ddp, opt, 0, 4)
        buf = io.BytesIO()
        with per_rank_state():     # this rank's replica, on purpose
            torch.save({"model": ddp.module.state_dict(), "optimizer": opt.state_dict(),
                        "algorithm": ddp.algorithm.state_dict()}, buf)
    finally:
        ddp.close()
    assert any(r is not None for r in torch.load(io.BytesIO(buf.getvalue()),
                                                 weights_only=False)["algorithm"]["state"]
               ["residual"])
    for restore_algorithm in (True, False):
        saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        ddp, opt = build(kwargs)
        try:
            ddp.module.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            if restore_algorithm:
                ddp.algorithm.load_state_dict(saved["algorithm"])
                assert same(ddp.algorithm.state_dict(), saved["algorithm"])
            run_steps(ddp, opt, 4, 8)
            resumed = final(ddp, opt)
            if n > 1 and restore_algorithm:
                other = dict(saved["algorithm"], rank=(rank + 1) % n)
                with pytest.raises(ValueError, match="rank"):
                    ddp.algorithm.load_state_dict(other)
        finally:
            ddp.close()
        assert same(resumed, full) == restore_algorithm


@pytest.mark.mpi
def test_half_precision_weights_keep_float32_state():
    """bfloat16 parameters: global weights, accumulators and the outer momentum are
    float32; training stays finite and the replicas agree right after an outer step
    (negative control: one iteration later they do not)."""
    n = commlib.get_world_size()
    out = train(MuLoCo(sync_every=2), steps=8, dtype=torch.bfloat16, bucket_cap_mb=0.0025)
    algo = out["ddp"].algorithm
    assert all(g.dtype == torch.float32 for g in algo._global)
    assert algo._residual and all(r.dtype == torch.float32 for r in algo._residual.values())
    assert all(torch.isfinite(p.float()).all() for p in out["ddp"].module.parameters())
    if n > 1:
        assert same_everywhere(list(out["ddp"].module.parameters()))
        apart = train(MuLoCo(sync_every=2), steps=9, dtype=torch.bfloat16,
                      bucket_cap_mb=0.0025)
        assert not same_everywhere(list(apart["ddp"].module.parameters()))


@pytest.mark.mpi
@pytest.mark.parametrize("compression", ["int2", "int8"])
def test_non_finite_weights_raise_on_every_rank_and_change_nothing(compression):
    """NaN in the last rank's weights after iteration 5 (H = 2, accumulators set by the
    outer steps after 2 and 4): the outer step after 6 raises NonFiniteError naming that
    rank on every rank; global weights, outer momentum and accumulators stay as before."""
    from commlib.base.errors import NonFiniteError
    n, rank = commlib.get_world_size(), commlib.get_rank()
    algo = MuLoCo(sync_every=2, compression=compression)
    before = {}

    def on_step(step, ddp):
        if step == 4:
            before.update(ddp.algorithm.state_dict()["state"])
            if rank == n - 1:
                with torch.no_grad():
                    next(ddp.module.parameters())[0, 0] = float("nan")

    with pytest.raises(NonFiniteError, match=rf"rank\(s\) \[{n - 1}\]"):
        train(algo, steps=8, on_step=on_step)
    after = algo.state_dict()["state"]
    assert all(r is not None for r in before["residual"])
    assert same(after, before)


def test_inner_optimizer_is_muon_for_matrices_and_adamw_for_the_rest():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 16),
                                 torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = muloco_inner_optimizer(module, lr=0.02, adamw_lr=0.001, weight_decay=0.1,
                                 adamw_params=["3.weight"])
    muon = [p for g in opt.muon.param_groups for p in g["params"]]
    adamw = [p for g in opt.adamw.param_groups for p in g["params"]]
    assert [id(p) for p in muon] == [id(module[1].weight)]
    assert {id(p) for p in adamw} == {id(p) for n, p in module.named_parameters()
                                      if n != "1.weight"}
    g = opt.muon.param_groups[0]     # (16, 8): the paper's lr * sqrt(fan_out / fan_in)
    assert g["lr"] * math.sqrt(max(1, 16 / 8)) == pytest.approx(0.02 * math.sqrt(16 / 8))
    assert g["lr"] * g["weight_decay"] == pytest.approx(0.02 * 0.1)
    assert opt.param_groups == opt.muon.param_groups + opt.adamw.param_groups
    x = torch.randint(0, 10, (5,))

    def step(o):
        o.zero_grad()
        module(x).square().mean().backward()
        o.step()

    step(opt)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)   # state_dict() holds the live state tensors
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    twin = muloco_inner_optimizer(module, lr=0.02, adamw_lr=0.001, weight_decay=0.1,
                                  adamw_params=["3.weight"])
    twin.load_state_dict(saved)
    before = [p.detach().clone() for p in module.parameters()]
    step(opt)
    after = [p.detach().clone() for p in module.parameters()]
    with torch.no_grad():
        for p, b in zip(module.parameters(), before):
            p.copy_(b)
    step(twin)
    assert all(torch.equal(p, a) for p, a in zip(module.parameters(), after))
    assert not any(torch.equal(a, b) for a, b in zip(after, before))
    opt.zero_grad()
    assert all(p.grad is None for p in module.parameters())
    with pytest.raises(ValueError, match="muon"):
        MuonWithAdamW([], [{"params": [module[2].bias]}], {}, {}).load_state_dict(saved)


def test_muloco_rejects_bad_arguments():
    for bad in (dict(compression="int3"), dict(topk_ratio=0), dict(topk_ratio=1.5),
                dict(error_decay=0), dict(error_decay=1.5), dict(error_feedback="yes"),
                dict(sync_every=0), dict(outer_lr=0), dict(outer_momentum=1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            MuLoCo(**bad)
    module = model()
    for bad in (dict(lr=0), dict(adamw_lr=-1.0), dict(momentum=1.0),
                dict(weight_decay=-0.1), dict(betas=(0.9, 1.0)), dict(eps=0.0),
                dict(adamw_params=["nope.weight"])):
        with pytest.raises(ValueError, match=next(iter(bad))):
            muloco_inner_optimizer(module, **bad)
    with pytest.raises(TypeError, match="module"):
        muloco_inner_optimizer([torch.zeros(2, 2)])
