"""K-FAC mathematics on one process: factors against per-example Fisher blocks, the
eigen/Cholesky preconditioners against direct solves, owner assignment, KL clipping and
hyperparameter checks. Also the independent single-process K-FAC reference that the
multi-rank tests compare against (validated here against the Fisher)."""
from __future__ import annotations

import itertools
import math

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402

from commlib.algorithms import get  # noqa: E402
from commlib.algorithms.kfac import inverses  # noqa: E402
from commlib.algorithms.kfac.assignment import assign, inversion_cost  # noqa: E402
from commlib.algorithms.kfac.factors import FactorCapture, update_running  # noqa: E402
from commlib.algorithms.kfac.kl_clip import clip_scale  # noqa: E402
from commlib.algorithms.kfac.layers import KFACLayer, find_layers  # noqa: E402
from commlib.algorithms.kfac.timers import Timers  # noqa: E402

D = torch.float64


# -- the reference: plain single-process K-FAC, written without the library ---------------
def kfac_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) or (isinstance(m, nn.Conv2d) and m.groups == 1)]


def reference_factors(model, x, y, loss_fn) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (A, G)} of one forward/backward on (x, y) with a mean-reduced loss:
    A = mean over examples and positions of [a; 1][a; 1]^T, G = mean over examples of the
    sum over positions of ds ds^T, ds = d(per-example loss)/d(output) = B * dL/d(output)."""
    seen, handles = {}, []
    for name, m in kfac_modules(model):
        def hook(mod, inp, out, name=name):
            out.retain_grad()
            seen[name] = (inp[0].detach(), out)
        handles.append(m.register_forward_hook(hook))
    loss_fn(model(x), y).backward()
    for h in handles:
        h.remove()
    model.zero_grad()
    return {name: _factors_of(m, *seen[name]) for name, m in kfac_modules(model)}


def _factors_of(m, x, out):
    if isinstance(m, nn.Conv2d):
        cols = F.unfold(x, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
        a = cols.transpose(1, 2).reshape(-1, cols.shape[1])
        g = out.grad.permute(0, 2, 3, 1).reshape(-1, out.shape[1])
    else:
        a, g = x.reshape(-1, x.shape[-1]), out.grad.reshape(-1, out.shape[-1])
    if m.bias is not None:
        a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)
    batch = x.shape[0]
    ds = g * batch
    return a.T @ a / a.shape[0], ds.T @ ds / batch


def grad_matrix(m: nn.Module) -> torch.Tensor:
    w = m.weight.grad.reshape(m.weight.shape[0], -1)
    return torch.cat([w, m.bias.grad[:, None]], 1) if m.bias is not None else w


def set_grad_matrix(m: nn.Module, v: torch.Tensor) -> None:
    n = m.weight[0].numel()
    m.weight.grad.copy_(v[:, :n].reshape_as(m.weight))
    if m.bias is not None:
        m.bias.grad.copy_(v[:, n])


def kron_solve(A, G, V, damping, method="eigen"):
    """(A kron G + damping I)^-1 vec(V) by a dense solve (eigen), or the factored-Tikhonov
    ((A + pi sqrt(d) I) kron (G + sqrt(d)/pi I))^-1 vec(V) (cholesky); vec stacks columns."""
    if method == "cholesky":
        pi = math.sqrt((torch.trace(A) / A.shape[0]) / (torch.trace(G) / G.shape[0]))
        r = math.sqrt(damping)
        M = torch.kron(A + pi * r * torch.eye(A.shape[0], dtype=D),
                       G + r / pi * torch.eye(G.shape[0], dtype=D))
    else:
        M = torch.kron(A, G) + damping * torch.eye(A.shape[0] * G.shape[0], dtype=D)
    x = torch.linalg.solve(M, V.T.reshape(-1))
    return x.reshape(V.shape[1], V.shape[0]).T


class ReferenceKFAC:
    """Single-process K-FAC with the library's schedule: running averages (first update
    copies), inverse refresh every inv_update_steps (the factors at that step are frozen
    until the next refresh), kron-solve preconditioning, KL clipping."""

    def __init__(self, damping=1e-3, factor_decay=0.95, factor_update_steps=1,
                 inv_update_steps=1, kl_clip=1e-3, lr=0.1, inverse="eigen", **_):
        self.damping, self.decay, self.kl_clip, self.lr = damping, factor_decay, kl_clip, lr
        self.f_steps, self.i_steps, self.method = factor_update_steps, inv_update_steps, inverse
        self.factors, self.frozen, self.last_scale = {}, {}, 1.0

    def update(self, step, batch_factors):
        if step % self.f_steps == 0:
            for name, (a, g) in batch_factors.items():
                if name not in self.factors:
                    self.factors[name] = (a.clone(), g.clone())
                else:
                    A, G = self.factors[name]
                    self.factors[name] = (self.decay * A + (1 - self.decay) * a,
                                          self.decay * G + (1 - self.decay) * g)
        if step % self.i_steps == 0:
            self.frozen = {k: (a.clone(), g.clone()) for k, (a, g) in self.factors.items()}

    def precondition(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {k: kron_solve(*self.frozen[k], v, self.damping, self.method)
               for k, v in grads.items()}
        self.last_scale = 1.0
        if self.kl_clip is not None:
            vg = sum(float((out[k] * grads[k]).sum()) for k in grads) * self.lr ** 2
            self.last_scale = min(1.0, math.sqrt(self.kl_clip / abs(vg)))
        return {k: v * self.last_scale for k, v in out.items()}


# -- factors against the Fisher ------------------------------------------------------------
def per_example_fisher(m: nn.Module, model, x, y, loss_fn) -> torch.Tensor:
    """vec(dW) vec(dW)^T of one example (bias column included), vec stacking columns."""
    model.zero_grad()
    loss_fn(model(x), y).backward()
    v = grad_matrix(m).T.reshape(-1)
    model.zero_grad()
    return torch.outer(v, v)


def capture_factors(model, layer_names, x, y, loss_fn):
    layers = [ly for ly in find_layers(model) if ly.name in layer_names]
    cap = FactorCapture(layers, Timers())
    cap.armed = True
    loss_fn(model(x), y).backward()
    cap.remove()
    model.zero_grad()
    return {ly.name: (cap.batch_factor(ly, "A"), cap.batch_factor(ly, "G")) for ly in layers}


def mse(out, y):
    return F.mse_loss(out, y)


def _linear_model(bias):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4, bias=bias), nn.Tanh(), nn.Linear(4, 3, bias=bias)).to(D)


def _conv_model(bias):
    # the second convolution covers its whole input: one output position, exact Fisher
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, bias=bias), nn.Tanh(),
                         nn.Conv2d(3, 4, 4, bias=bias), nn.Flatten()).to(D)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_one_example_factors_are_its_fisher_block(kind, bias):
    if kind == "linear":
        model, names = _linear_model(bias), ["0", "2"]
        x, y = torch.randn(1, 5, dtype=D), torch.randn(1, 3, dtype=D)
    else:
        model, names = _conv_model(bias), ["2"]
        x, y = torch.randn(1, 2, 4, 4, dtype=D), torch.randn(1, 4, dtype=D)
    mods = dict(model.named_modules())
    for source in (capture_factors(model, names, x, y, mse),
                   reference_factors(model, x, y, mse)):
        for name in names:
            A, G = source[name]
            fisher = per_example_fisher(mods[name], model, x, y, mse)
            torch.testing.assert_close(torch.kron(A, G), fisher, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_batch_factors_are_means_of_per_example_factors(kind):
    """The B scaling of G: a mean-reduced loss over B examples gives the mean of the
    one-example factors (which are the Fisher blocks, test above)."""
    model = _linear_model(True) if kind == "linear" else _conv_model(True)
    names = ["0", "2"]
    B = 5
    x = torch.randn(B, 5, dtype=D) if kind == "linear" else torch.randn(B, 2, 4, 4, dtype=D)
    y = torch.randn(B, 3 if kind == "linear" else 4, dtype=D)
    whole = capture_factors(model, names, x, y, mse)
    singles = [capture_factors(model, names, x[i:i + 1], y[i:i + 1], mse) for i in range(B)]
    for name in names:
        for k in range(2):
            mean = sum(s[name][k] for s in singles) / B
            torch.testing.assert_close(whole[name][k], mean, rtol=1e-12, atol=1e-14)


CONVS = [dict(kernel_size=3, padding=1), dict(kernel_size=3, stride=2, padding=2, dilation=2),
         dict(kernel_size=(2, 3), padding="same"), dict(kernel_size=3, padding=1,
                                                        padding_mode="reflect", bias=False),
         dict(kernel_size=1, padding=0, padding_mode="circular")]


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("conv_kw", CONVS)
def test_rows_reproduce_the_weight_gradient(conv_kw):
    """sum over rows of g a^T is the gradient matrix: patches are in the weight's order,
    padding (string, modes), stride and dilation are those of the convolution."""
    torch.manual_seed(3)
    conv = nn.Conv2d(3, 4, **conv_kw).to(D)
    layer = find_layers(conv)[0]
    x = torch.randn(2, 3, 7, 6, dtype=D)
    out = conv(x)
    out.retain_grad()
    (out ** 3).mean().backward()
    g_rows, batch = layer.output_rows(out.grad)
    assert batch == 2
    torch.testing.assert_close(g_rows.T @ layer.input_rows(x), layer.grad_matrix(),
                               rtol=1e-12, atol=1e-14)


def test_linear_rows_with_sequence_dimension():
    torch.manual_seed(3)
    lin = nn.Linear(4, 3).to(D)
    layer = find_layers(lin)[0]
    x = torch.randn(2, 5, 4, dtype=D)
    out = lin(x)
    out.retain_grad()
    out.sin().sum().backward()
    g_rows, batch = layer.output_rows(out.grad)
    assert batch == 2 and g_rows.shape == (10, 3)
    torch.testing.assert_close(g_rows.T @ layer.input_rows(x), layer.grad_matrix())


def test_find_layers_registers_linear_and_conv_in_module_order():
    model = nn.Sequential(nn.Conv2d(4, 4, 3, bias=False), nn.BatchNorm2d(4),
                          nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(), nn.Linear(8, 2),
                          nn.LayerNorm(2), nn.Linear(2, 2))
    model[6].weight.requires_grad_(False)
    layers = find_layers(model)
    assert [(ly.name, ly.d_in, ly.d_out) for ly in layers] == [("0", 36, 4), ("4", 9, 2)]
    assert [ly.index for ly in layers] == [0, 1]


def test_write_grad_is_in_place_and_keeps_none():
    lin = nn.Linear(3, 2).to(D)
    layer = find_layers(lin)[0]
    lin.weight.grad = torch.zeros(2, 3, dtype=D)
    view = lin.weight.grad
    m = torch.arange(8, dtype=D).reshape(2, 4)
    layer.write_grad(m)
    assert lin.weight.grad is view and lin.bias.grad is None
    torch.testing.assert_close(view, m[:, :3])


# -- inverses --------------------------------------------------------------------------
def _spd_factors(d_in, d_out, seed, rank_deficient=False, zero_rows=False):
    """Random PSD factors; ``zero_rows``: some inputs and outputs are always 0 (exactly zero
    rows and columns, as with padding-only patch positions)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d_in, 2 if rank_deficient else 3 * d_in, generator=g, dtype=D)
    b = torch.randn(d_out, 3 * d_out, generator=g, dtype=D) * 10
    if zero_rows:
        a[[0, 3, 4]] = 0
        b[[2]] = 0
    return a @ a.T / a.shape[1], b @ b.T / b.shape[1]


@pytest.mark.parametrize("structure", [{}, {"rank_deficient": True}, {"zero_rows": True},
                                       {"rank_deficient": True, "zero_rows": True}])
@pytest.mark.parametrize("damping", [1e-3, 0.1])
def test_eigen_path_is_the_exact_damped_kronecker_solve(damping, structure):
    A, G = _spd_factors(6, 5, seed=1, **structure)
    V = torch.randn(5, 6, dtype=D)
    inv = inverses.compute_inverse("eigen", A, G, damping)
    assert [tuple(t.shape) for t in inv] == inverses.inverse_shapes("eigen", 6, 5)
    for q, values, M in ((inv[0], inv[1], A), (inv[2], inv[3], G)):  # a true decomposition
        torch.testing.assert_close(q @ torch.diag(values) @ q.T, M, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(q.T @ q, torch.eye(len(values), dtype=D), rtol=0, atol=1e-12)
    got = inverses.precondition("eigen", inv, V, damping)
    torch.testing.assert_close(got, kron_solve(A, G, V, damping), rtol=1e-9, atol=1e-10)


def test_eigen_falls_back_to_float64_when_lapack_does_not_converge(monkeypatch):
    A, G = (m.float() for m in _spd_factors(6, 5, seed=3))
    real = torch.linalg.eigh

    def failing_in_float32(M):
        if M.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return real(M)

    monkeypatch.setattr(torch.linalg, "eigh", failing_in_float32)
    inv = inverses.compute_inverse("eigen", A, G, 1e-3)
    assert all(t.dtype == torch.float32 for t in inv)
    torch.testing.assert_close(inv[1], real(A.double())[0].float())
    V = torch.randn(5, 6)
    torch.testing.assert_close(inverses.precondition("eigen", inv, V, 1e-3),
                               kron_solve(A.double(), G.double(), V.double(), 1e-3).float(),
                               rtol=1e-4, atol=1e-5)


def test_cholesky_path_is_the_factored_tikhonov_solve():
    A, G = _spd_factors(6, 5, seed=2)
    V = torch.randn(5, 6, dtype=D)
    inv = inverses.compute_inverse("cholesky", A, G, 1e-2)
    got = inverses.precondition("cholesky", inv, V, 1e-2)
    torch.testing.assert_close(got, kron_solve(A, G, V, 1e-2, "cholesky"), rtol=1e-9, atol=1e-10)
    assert not torch.allclose(got, kron_solve(A, G, V, 1e-2))  # it is an approximation


def test_inverse_numel_counts_every_tensor():
    assert inverses.inverse_numel("eigen", 7, 3) == 49 + 7 + 9 + 3
    assert inverses.inverse_numel("cholesky", 7, 3) == 49 + 9


def test_running_average():
    r = torch.full((2, 2), 4.0, dtype=D)
    update_running(r, torch.ones(2, 2, dtype=D), 0.75, first=False)
    torch.testing.assert_close(r, torch.full((2, 2), 3.25, dtype=D))
    update_running(r, torch.zeros(2, 2, dtype=D), 0.75, first=True)
    assert r.abs().sum() == 0


# -- assignment ------------------------------------------------------------------------
def _layers(dims):
    return [KFACLayer(i, f"l{i}", None, d_in, d_out) for i, (d_in, d_out) in enumerate(dims)]


def test_greedy_balances_cubic_cost_with_ties_by_layer_index():
    layers = _layers([(2, 2), (10, 1), (2, 2), (9, 3), (2, 2)])
    assert assign(layers, 2) == [1, 0, 1, 1, 1]
    assert assign(_layers([(3, 3)] * 5), 3) == [0, 1, 2, 0, 1]
    assert assign(layers, 4, "round_robin") == [0, 1, 2, 3, 0]
    assert assign(layers, 1) == [0] * 5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=7),
       st.integers(1, 4))
def test_greedy_is_within_the_lpt_bound_of_the_best_assignment(dims, n):
    layers = _layers(dims)
    owners = assign(layers, n)
    assert owners == assign(layers, n)  # deterministic
    assert all(0 <= r < n for r in owners)
    costs = [inversion_cost(ly) for ly in layers]

    def makespan(own):
        return max(sum(c for c, r in zip(costs, own) if r == k) for k in range(n))

    best = min(makespan(own) for own in itertools.product(range(n), repeat=len(layers)))
    assert makespan(owners) <= (4 / 3 - 1 / (3 * n)) * best + 1e-9


def test_assign_rejects_unknown_methods():
    with pytest.raises(ValueError, match="round_robin"):
        assign(_layers([(2, 2)]), 2, "random")


# -- KL clipping -----------------------------------------------------------------------
def test_kl_clip_scale():
    v, g = torch.full((3,), 2.0, dtype=D), torch.full((3,), 1.0, dtype=D)  # <v, g> = 6
    assert clip_scale([(v, g)], lr=0.1, kl_clip=None) == 1.0
    assert clip_scale([(v, g)], lr=0.1, kl_clip=1.0) == 1.0
    assert clip_scale([(v, g), (v, -g)], lr=0.1, kl_clip=1e-3) == 1.0  # zero sum: no scaling
    assert clip_scale([(v, g)], lr=0.1, kl_clip=1e-3) == pytest.approx(math.sqrt(1e-3 / 0.06))


# -- configuration ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["d_kfac", "dp_kfac"])
def test_documented_defaults(name):
    algo = get(name)
    assert (algo.damping, algo.factor_decay, algo.factor_update_steps, algo.inv_update_steps,
            algo.kl_clip, algo.lr, algo.assignment, algo.inverse) == \
        (1e-3, 0.95, 1, 1, 1e-3, None, "greedy", "eigen")
    assert algo.average and algo.name == name


@pytest.mark.parametrize("kw, match", [
    ({"damping": 0}, "damping"), ({"factor_decay": 1.0}, "factor_decay"),
    ({"factor_update_steps": 0}, "factor_update_steps"), ({"inv_update_steps": 1.5}, "inv"),
    ({"kl_clip": -1}, "kl_clip"), ({"lr": 0}, "lr"), ({"assignment": "x"}, "assignment"),
    ({"inverse": "svd"}, "inverse")])
def test_bad_hyperparameters_are_rejected(kw, match):
    for name in ("d_kfac", "dp_kfac"):
        with pytest.raises(ValueError, match=match):
            get(name, **kw)


# -- the reference itself --------------------------------------------------------------
def test_reference_eigen_schedule_matches_the_library_preconditioner():
    """Sanity of the reference used by the multi-rank tests: the library's eigen path and
    the reference's kron solve agree on the same frozen factors."""
    ref = ReferenceKFAC(kl_clip=None)
    A, G = _spd_factors(4, 3, seed=5)
    ref.update(0, {"l": (A, G)})
    V = torch.randn(3, 4, dtype=D)
    inv = inverses.compute_inverse("eigen", A, G, 1e-3)
    torch.testing.assert_close(ref.precondition({"l": V})["l"],
                               inverses.precondition("eigen", inv, V, 1e-3), rtol=1e-9, atol=1e-9)
