"""``demo`` (DeMo, arXiv 2411.19870): against a float64 reference of bloc97/DeMo's
``DeMo.step`` written here in plain torch (every rank's replica after every step, 1e-10);
its bytes per step against the design formula, exactly; its convergence on the label-skewed
problem (every replica) with negative controls; non-finite gradients and AMP skipped
steps; bit-exact resume; bad arguments.

The reference (:class:`Reference`) simulates all ``n`` ranks from their gradients (every
rank computes its own at the reference's weights; an allgather gives everyone all of
them): per parameter, as the authors' code, ``p *= 1 - lr wd``; per rank ``delta = decay
delta + lr grad``, the chunked 2-D (or 1-D) DCT (``einsum`` with scipy's orthonormal DCT
matrices, blocks of the largest divisor not above ``chunk_size``), ``torch.topk`` of the
magnitudes per chunk, ``delta -= IDCT(scatter(top-k))``; then the ranks' indices and
values concatenated, ``scatter_reduce(mean, include_self=False)``, the inverse DCT, the
sign, ``p -= lr * sign``.
"""
from __future__ import annotations

import io
import math
import warnings

import numpy as np
import pytest

from helpers import require

torch = pytest.importorskip("torch")
require("sklearn")
require("scipy")
import scipy.fft  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.func import functional_call  # noqa: E402

import commlib  # noqa: E402
from algo_harness import (  # noqa: E402
    BUCKET_MB,
    batch_indices,
    bus_bytes,
    digits,
    gathered,
    model,
    param_groups,
    train,
)
from commlib.algorithms.demo import DeMo, bytes_per_step  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")

D = torch.float64
TOL = 1e-10


# -- the reference: bloc97/DeMo's demo.py, n replicas, float64 ---------------------------

def ref_split(n: int, target: int) -> int:
    """``_get_smaller_split``: the largest divisor of ``n`` not above ``target``."""
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= target)


def ref_dct(n: int) -> torch.Tensor:
    """``M`` with ``M @ x`` the orthonormal DCT-II of ``x`` (scipy's, not commlib's), its
    entries that are zero in exact arithmetic (``cos(pi/2)``: odd frequencies at the
    middle sample of odd sizes) made exactly 0 as they are in the exact transform. (The
    authors' FFT-built matrices leave rounding noise there, and with it the sign of an
    update element that only those entries reach: e.g. blocks of 5 when the top-k of a
    chunk holds only odd frequencies, at 1 rank.)"""
    m = scipy.fft.dct(np.eye(n), norm="ortho", axis=0)
    m[np.abs(m) < 1e-12] = 0.0
    return torch.from_numpy(m)


class Reference:
    """``DeMo.step`` of the authors' code for ``n`` ranks that all hold ``params``."""

    def __init__(self, params, n: int, chunk: int, topk: int, decay: float, wd: float):
        self.params = [p.detach().clone() for p in params]
        self.delta = [[torch.zeros_like(p) for p in self.params] for _ in range(n)]
        self.n, self.chunk, self.topk, self.decay, self.wd = n, chunk, topk, decay, wd

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() > 1:   # "(y h) (x w) -> y h x w", einsum, "y x h w -> y x (h w)"
            s1, s2 = ref_split(x.shape[0], self.chunk), ref_split(x.shape[1], self.chunk)
            y = x.reshape(x.shape[0] // s1, s1, x.shape[1] // s2, s2)
            c = torch.einsum("yhxw,bh,dw->yxbd", y, ref_dct(s1), ref_dct(s2))
            return c.reshape(c.shape[0], c.shape[1], s1 * s2)
        s = ref_split(x.shape[0], self.chunk)
        return torch.einsum("xw,bw->xb", x.reshape(-1, s), ref_dct(s))

    def decode(self, c: torch.Tensor, shape) -> torch.Tensor:
        if len(shape) > 1:
            s1, s2 = ref_split(shape[0], self.chunk), ref_split(shape[1], self.chunk)
            c = c.reshape(c.shape[0], c.shape[1], s1, s2)
            return torch.einsum("yxbd,bh,dw->yhxw", c, ref_dct(s1), ref_dct(s2)).reshape(shape)
        s = ref_split(shape[0], self.chunk)
        return torch.einsum("xb,bw->xw", c, ref_dct(s)).reshape(shape)

    def step(self, grads: list[list[torch.Tensor]], lr: float) -> None:
        """``grads[r][i]``: rank ``r``'s gradient of parameter ``i``."""
        for i, p in enumerate(self.params):
            p.mul_(1.0 - lr * self.wd)
            idxs, vals = [], []
            for r in range(self.n):
                delta = self.delta[r][i]
                delta.mul_(self.decay).add_(grads[r][i], alpha=lr)
                c = self.encode(delta)
                k = min(max(self.topk, 1), c.shape[-1])
                idx = torch.topk(c.abs(), k=k, dim=-1, largest=True, sorted=False).indices
                val = torch.gather(c, -1, idx)
                sent = torch.zeros_like(c).scatter_reduce(-1, idx, val, reduce="mean",
                                                          include_self=False)
                delta.sub_(self.decode(sent, delta.shape))
                idxs.append(idx)
                vals.append(val)
            mean = torch.zeros_like(c).scatter_reduce(-1, torch.cat(idxs, -1),
                                                      torch.cat(vals, -1), reduce="mean",
                                                      include_self=False)
            p.sub_(self.decode(mean, p.shape).sign(), alpha=lr)


def odd_model() -> torch.nn.Module:
    """Dimensions 14 and 7 (prime: blocks of 1 for chunk_size 4) besides 64 and 10."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 14), torch.nn.Tanh(),
                               torch.nn.Linear(14, 7), torch.nn.Tanh(),
                               torch.nn.Linear(7, 10)).to(D)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def against_reference(cfg: dict, algorithm, steps: int = 6) -> tuple[float, bool]:
    """Train ``algorithm`` (float64, SGD momentum 0) and the reference side by side; the
    largest difference of any rank's weights from the reference's over the steps, and
    whether every rank's replica was bitwise the same after every step."""
    rank, n = commlib.get_rank(), commlib.get_world_size()
    make = cfg.get("model", lambda: model(D))
    xs, ys = digits(D)
    ddp = commlib.DistributedDataParallel(make(), algorithm=algorithm,
                                          bucket_cap_mb=cfg.get("bucket_cap_mb", BUCKET_MB))
    if make is not odd_model:
        assert len(ddp._ctx.buckets) >= 3, ddp._ctx.buckets
    opt = torch.optim.SGD(ddp.module.parameters(), lr=cfg["lr"], momentum=0.0,
                          weight_decay=cfg["wd"])
    cfg["opt"] = opt
    names = [name for name, _ in ddp.module.named_parameters()]
    ref = Reference(make().parameters(), n, cfg["chunk_size"], cfg["topk"], cfg["decay"],
                    cfg["wd"])
    net = make()
    gap, identical = 0.0, True
    try:
        for step in range(steps):
            lr = cfg["lr"] * cfg.get("lr_factor", 1.0) ** step
            for g in opt.param_groups:
                g["lr"] = lr
            idx = batch_indices(rank, n, step)
            x, y = xs[idx], ys[idx]
            leaves = [p.clone().requires_grad_() for p in ref.params]
            loss = F.cross_entropy(functional_call(net, dict(zip(names, leaves)), (x,)), y)
            everyone = torch.from_numpy(gathered(torch.autograd.grad(loss, leaves)))
            grads = [list(torch.split(row, [p.numel() for p in ref.params])) for row in everyone]
            ref.step([[g.view_as(p) for g, p in zip(row, ref.params)] for row in grads], lr)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            replicas = gathered(ddp.module.parameters())
            identical &= all(np.array_equal(r, replicas[0]) for r in replicas)
            gap = max(gap, float(np.max(np.abs(replicas - flat(ref.params).numpy()))))
    finally:
        ddp.close()
    return gap, identical


def schedule(cfg: dict):
    """The learning rate the coming optimizer step uses (the test sets it before backward)."""
    return lambda: cfg["opt"].param_groups[0]["lr"]


CASES = {
    # blocks 8x8 and 5x8 (2-D), 8 and 5 (1-D), a learning-rate schedule folded into the
    # momentum, weight decay on every parameter
    "chunk8_schedule": dict(chunk_size=8, topk=3, decay=0.999, wd=0.01, lr=0.02,
                            lr_factor=0.7, fold="schedule"),
    # one block per matrix (2048, 1024, 320 coefficients: 2-byte indices), biases sent
    # whole (topk >= their size); lr=None under a constant learning rate
    "chunk64_const": dict(chunk_size=64, topk=32, decay=0.9, wd=0.0, lr=0.01, fold=None),
    # prime dimension 7 (blocks of 1), 14 (blocks of 2), a float lr
    "odd_shapes": dict(chunk_size=4, topk=2, decay=0.5, wd=1e-3, lr=0.02, fold=0.02,
                       model=odd_model, bucket_cap_mb=0.001),
}


class NoErrorFeedback(DeMo):
    """Broken: what is sent stays in the momentum."""

    def _remove_sent(self, momentum, sent):
        pass


class NeverCommunicates(DeMo):
    """Broken: each rank decodes only its own coefficients (no exchange)."""

    def exchange(self, ctx, payload):
        return payload.unsqueeze(0)


def demo_for(cfg: dict, cls=DeMo, **overrides) -> DeMo:
    fold = cfg["fold"]
    lr = schedule(cfg) if fold == "schedule" else fold
    kwargs = dict(chunk_size=cfg["chunk_size"], topk=cfg["topk"],
                  compression_decay=cfg["decay"], lr=lr)
    kwargs.update(overrides)
    return cls(**kwargs)


@pytest.mark.mpi
@pytest.mark.parametrize("case", sorted(CASES))
def test_demo_matches_the_reference_update_after_every_step_on_every_replica(case):
    cfg = dict(CASES[case])
    gap, identical = against_reference(cfg, demo_for(cfg))
    print(f"demo vs reference, {case}: largest difference {gap:.3g}")
    assert identical, "replicas differ"
    assert gap <= TOL, f"{case}: off the reference by {gap:.3g}"


@pytest.mark.mpi
def test_reference_comparison_rejects_broken_variants():
    """Negative controls: the same comparison rejects no error feedback, a schedule not
    folded into the momentum (lr=None under a changing learning rate), and (with peers)
    no exchange."""
    cfg = dict(CASES["chunk8_schedule"])
    controls = [demo_for(cfg, NoErrorFeedback), demo_for(cfg, lr=None)]
    if commlib.get_world_size() > 1:
        controls.append(demo_for(cfg, NeverCommunicates))
    for control in controls:
        gap, _ = against_reference(cfg, control)
        assert gap > 1e-4, (type(control).__name__, control.lr, gap)


# -- bytes per step ----------------------------------------------------------------------

def design_bytes(shapes, chunk: int, topk: int, element: int) -> int:
    """Per rank and step: chunks * k * (element + index bytes), indices in the smallest of
    1, 2, 4 bytes holding the chunk's largest index."""
    total = 0
    for shape in shapes:
        dims = [math.prod(shape)] if len(shape) == 1 else [shape[0], math.prod(shape[1:])]
        blocks = [ref_split(d, chunk) for d in dims]
        coefficients = math.prod(blocks)
        chunks = math.prod(d // b for d, b in zip(dims, blocks))
        width = 1 if coefficients <= 256 else 2 if coefficients <= 65536 else 4
        total += chunks * min(topk, coefficients) * (element + width)
    return total


@pytest.mark.mpi
def test_bytes_per_step_are_the_formula_and_a_small_fraction_of_allreduce():
    n = commlib.get_world_size()
    steps, first = 8, 2
    shapes = [tuple(p.shape) for p in model().parameters()]
    chunk, topk = 16, 2
    design = design_bytes(shapes, chunk, topk, 4)
    assert design == bytes_per_step(shapes, chunk, topk, 4) == 190
    out = train(DeMo(chunk_size=chunk, topk=topk), steps=steps, count_from=first,
                optimizer=lambda ddp: torch.optim.SGD(ddp.module.parameters(), lr=0.01))
    stats = out["stats"]
    buckets = len(out["ddp"]._ctx.buckets)
    assert set(stats) == {"allgather"}, stats
    assert stats["allgather"]["calls"] == buckets * (steps - first)
    assert stats["allgather"]["bytes"] == design * (steps - first)
    assert bus_bytes(stats) == (n - 1) * design * (steps - first)
    ref = train("gradient_allreduce", steps=steps, count_from=first)
    if n > 1:
        ratio = bus_bytes(stats) / bus_bytes(ref["stats"])
        grads = sum(math.prod(s) for s in shapes) * 4
        assert abs(ratio - n * design / (2 * grads)) < 1e-3, ratio
        print(f"demo chunk_size={chunk} topk={topk}: {design} B sent per rank per step, "
              f"{ratio:.4f} of gradient_allreduce's bus bytes at {n} ranks")
        assert ratio <= 1 / 30, ratio


# -- convergence on the label-skewed problem ---------------------------------------------

STEPS = 60


def decaying(make, holder: dict):
    """``make(ddp)``'s optimizer with the learning rate decaying linearly to 0 over
    :data:`STEPS` (sign updates need the annealing); ``holder["opt"]`` is the optimizer."""
    def optimizer(ddp):
        opt = make(ddp)
        base = [g["lr"] for g in opt.param_groups]
        done = [0]

        def post(o, args, kwargs):
            done[0] += 1
            for g, b in zip(o.param_groups, base):
                g["lr"] = b * max(0.0, 1 - done[0] / STEPS)

        opt.register_step_post_hook(post)
        holder["opt"] = opt
        return opt
    return optimizer


def train_demo(cls=DeMo, chunk=64, topk=32, decay=0.99, lr=0.06) -> dict:
    holder: dict = {}
    algo = cls(chunk_size=chunk, topk=topk, compression_decay=decay,
               lr=lambda: holder["opt"].param_groups[0]["lr"])
    return train(algo, steps=STEPS, optimizer=decaying(
        lambda ddp: torch.optim.SGD(param_groups(ddp.module), lr=lr), holder))


CONVERGED = 0.6    # every replica's whole-set loss (measured 0.25-0.45 at 1-4 ranks)


@pytest.mark.mpi
def test_demo_converges_per_replica_and_rejects_broken_variants():
    """DeMo(64, 32, decay 0.99), SGD with a linearly decaying learning rate, 60 steps:
    every replica below :data:`CONVERGED`; the controls (no error feedback; with peers, no
    exchange: each rank decodes its own coefficients) fail that check with a margin: their
    worst replica above 1.5 times it (measured at 1-4 ranks: DeMo 0.25-0.45; no error
    feedback 2.7-4.9; no exchange 1.07-1.71)."""
    n = commlib.get_world_size()
    out = train_demo()
    worst = max(out["losses"])
    no_ef = train_demo(NoErrorFeedback)
    lines = [f"demo: replicas {np.round(out['losses'], 4).tolist()}; no error feedback "
             f"{np.round(no_ef['losses'], 4).tolist()}"]
    if n > 1:
        alone = train_demo(NeverCommunicates)
        lines.append(f"never communicates: {np.round(alone['losses'], 4).tolist()}")
    print("; ".join(lines))
    assert len(set(out["losses"])) == 1, out["losses"]          # bitwise equal replicas
    assert worst <= CONVERGED, lines
    assert max(no_ef["losses"]) > 1.5 * CONVERGED, lines
    if n > 1:
        assert max(alone["losses"]) > 1.5 * CONVERGED, lines


# -- non-finite gradients and AMP --------------------------------------------------------

def small_run(steps=8, nan_at=None, leave_out=None, skip_anyway=None, scaler=None,
              pass_scaler=True):
    """Harness model, DeMo(16, 2), plain SGD; GradScaler-style skipping (no step when a
    local gradient is not finite). ``nan_at``: the last rank's loss is NaN there;
    ``leave_out``: that step never happens; ``skip_anyway``: every rank skips that finite
    step (a control). Returns the final weights and the skipped steps."""
    rank, n = commlib.get_rank(), commlib.get_world_size()
    xs, ys = digits()
    algo = DeMo(chunk_size=16, topk=2, grad_scaler=scaler if pass_scaler else None)
    ddp = commlib.DistributedDataParallel(model(), algorithm=algo, bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.SGD(ddp.module.parameters(), lr=0.01)
    skipped = []
    try:
        for step in range(steps):
            if step == leave_out:
                continue
            idx = batch_indices(rank, n, step)
            opt.zero_grad()
            loss = F.cross_entropy(ddp(xs[idx]), ys[idx])
            if step == nan_at and rank == n - 1:
                loss = loss * float("nan")
            if scaler is not None:
                before = flat(ddp.module.parameters())
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                if torch.equal(before, flat(ddp.module.parameters())):
                    skipped.append(step)
                continue
            loss.backward()
            if all(bool(torch.isfinite(p.grad).all()) for p in ddp.module.parameters()) \
                    and step != skip_anyway:
                opt.step()
            else:
                skipped.append(step)
        return flat(ddp.module.parameters()), skipped
    finally:
        ddp.close()


@pytest.mark.mpi
def test_nan_on_one_rank_is_skipped_everywhere_and_leaves_no_trace():
    if commlib.get_world_size() == 1:
        pytest.skip("needs peers")
    with_nan, skipped = small_run(nan_at=4)
    reference, _ = small_run(leave_out=4)
    assert skipped == [4], skipped                                  # on every rank
    assert torch.isfinite(with_nan).all()
    replicas = gathered([with_nan])
    assert all(np.array_equal(r, replicas[0]) for r in replicas)
    assert torch.equal(with_nan, reference)
    kept, skipped = small_run(skip_anyway=4)     # control: the momentum of a skipped
    assert skipped == [4]                        # (finite) step was kept: it shows
    assert not torch.equal(kept, reference)


@pytest.mark.mpi
def test_grad_scaler_skips_everywhere_and_steps_by_exactly_lr_times_sign():
    """With ``grad_scaler=``: the AMP run equals the unscaled run bitwise (the momentum
    unscaled, the update ``sign * scale`` unscaled by the scaler); a NaN on one rank backs
    the scale off once and skips that step on every rank. Control: without
    ``grad_scaler=`` the weights differ."""
    n = commlib.get_world_size()
    plain, _ = small_run()

    def scaler():
        return torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)

    amp, skipped = small_run(scaler=scaler())               # the scale grows at 3 and 6
    assert skipped == [] and torch.equal(amp, plain)
    unscaled, _ = small_run(scaler=scaler(), pass_scaler=False)
    assert not torch.equal(unscaled, plain)
    if n > 1:
        s = scaler()
        with_nan, skipped = small_run(nan_at=4, scaler=s)
        assert skipped == [4], skipped
        # 2048 after steps 0-2, 1024 after the NaN at 4, 2048 after steps 5-7
        assert s.get_scale() == 2048.0, s.get_scale()
        reference, _ = small_run(leave_out=4)
        assert torch.equal(with_nan, reference)
        replicas = gathered([with_nan])
        assert all(np.array_equal(r, replicas[0]) for r in replicas)


# -- resume ------------------------------------------------------------------------------

def resume_run(k: int, load: bool = True, kwargs=None) -> tuple[torch.Tensor, torch.Tensor]:
    """2k uninterrupted iterations, and k + k with a state saved (torch.save) and loaded
    into a fresh wrapper (with the algorithm's state unless ``load`` is False)."""
    rank, n = commlib.get_rank(), commlib.get_world_size()
    xs, ys = digits()
    kwargs = kwargs or dict(chunk_size=16, topk=2, compression_decay=0.95)

    def build():
        ddp = commlib.DistributedDataParallel(model(), algorithm=DeMo(**kwargs),
                                              bucket_cap_mb=BUCKET_MB)
        return ddp, torch.optim.SGD(param_groups(ddp.module), lr=0.01)

    def steps(ddp, opt, first, last):
        for step in range(first, last):
            idx = batch_indices(rank, n, step)
            opt.zero_grad()
            F.cross_entropy(ddp(xs[idx]), ys[idx]).backward()
            opt.step()

    ddp, opt = build()
    try:
        steps(ddp, opt, 0, 2 * k)
        full = flat(ddp.module.parameters())
    finally:
        ddp.close()
    ddp, opt = build()
    try:
        steps(ddp, opt, 0, k)
        buf = io.BytesIO()
        torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                    "algorithm": ddp.algorithm.state_dict()}, buf)
    finally:
        ddp.close()
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    ddp, opt = build()
    try:
        ddp.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        if load:
            ddp.algorithm.load_state_dict(saved["algorithm"])
            again = ddp.algorithm.state_dict()
            assert all(torch.equal(a, b) for a, b in zip(again["state"]["momentum"],
                                                         saved["algorithm"]["state"]["momentum"]))
        steps(ddp, opt, k, 2 * k)
        return full, flat(ddp.module.parameters())
    finally:
        ddp.close()


@pytest.mark.mpi
def test_resume_is_bit_exact_and_needs_the_momentum():
    full, resumed = resume_run(4)
    assert torch.equal(full, resumed)
    full, skipped = resume_run(4, load=False)       # control: momentum not restored
    assert not torch.equal(full, skipped)


@pytest.mark.mpi
def test_load_state_dict_refuses_what_does_not_fit():
    ddp = commlib.DistributedDataParallel(model(), algorithm=DeMo(chunk_size=16, topk=2),
                                          bucket_cap_mb=BUCKET_MB)
    try:
        xs, ys = digits()
        F.cross_entropy(ddp(xs[:8]), ys[:8]).backward()
        good = ddp.algorithm.state_dict()
        assert good["state"]["momentum"][0] is not None
        bad = dict(good, state=dict(good["state"], momentum=[
            m[:-1] for m in good["state"]["momentum"]]))
        with pytest.raises(ValueError, match="momentum of bucket 0"):
            ddp.algorithm.load_state_dict(bad)
        with pytest.raises(ValueError, match="the rank"):
            ddp.algorithm.load_state_dict(dict(good, rank=good["rank"] + 1))
        ddp.algorithm.load_state_dict(good)
    finally:
        ddp.close()


# -- arguments and the paired optimizer --------------------------------------------------

def test_bad_arguments_raise_naming_them():
    for kwargs, name in [(dict(chunk_size=0), "chunk_size"), (dict(chunk_size=2.5), "chunk_size"),
                         (dict(topk=0), "topk"), (dict(topk=True), "topk"),
                         (dict(compression_decay=1.0), "compression_decay"),
                         (dict(compression_decay=-0.1), "compression_decay"),
                         (dict(lr=0.0), "lr"), (dict(lr=float("nan")), "lr"),
                         (dict(lr="0.1"), "lr")]:
        with pytest.raises(ValueError, match=name):
            DeMo(**kwargs)
    with pytest.raises(TypeError, match="grad_scaler"):
        DeMo(grad_scaler=3)
    DeMo(lr=lambda: 0.1, compression_decay=0.0)


def test_optimizer_pairing_is_checked():
    xs, ys = digits()
    ddp = commlib.DistributedDataParallel(model(), algorithm=DeMo(chunk_size=16, topk=2))
    try:
        def step(opt):
            opt.zero_grad()
            F.cross_entropy(ddp(xs[:8]), ys[:8]).backward()
            opt.step()

        with pytest.raises(ValueError, match="maximize"):
            step(torch.optim.SGD(ddp.parameters(), lr=0.01, maximize=True))
        for opt in (torch.optim.Adam(ddp.parameters(), lr=0.01),
                    torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)):
            with pytest.warns(UserWarning, match="not DeMo"):
                step(opt)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step(torch.optim.SGD(ddp.parameters(), lr=0.01, weight_decay=0.1))
    finally:
        ddp.close()
