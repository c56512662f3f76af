"""Differential suite: tensor-sharded layers against one process, float64, after every step.

Each rank builds the unsharded model from the case's seed and trains it alone beside the
sharded one (the same data on every rank of the tensor-parallel group); after every step
the outputs, gradients (``None`` exactly where one process has ``None``), parameters and
buffers must match (sharded layers compared through their gathered full weights).
Generated cases, over every tensor-parallel group size dividing the world:

* ``shard_model`` on generated models: Linear stacks with activations and nested
  Sequentials, layers too narrow to split, frozen weights and biases, a Linear used at two
  places, BatchNorm buffers, language models whose head is tied to the embedding;
* ``VocabParallelEmbedding`` (``padding_idx``, ``max_norm``/``norm_type``) feeding a
  column-sharded head and ``parallel_cross_entropy`` (``ignore_index`` targets,
  ``reduction``, ``label_smoothing``, 1-D and 2-D targets), against ``nn.Embedding``,
  ``nn.Linear`` and ``F.cross_entropy``; out-of-range ids and targets must raise
  ``IndexError`` on every rank.

Negative controls the same checks must reject: a ``shard_model`` that unties (the old
planner), sharded layers that forget ``requires_grad=False``, a cross-entropy that counts
ignored targets, an embedding that ignores ``padding_idx`` or ``max_norm``.
"""
import copy
import dataclasses
import os

import numpy as np
import pytest
import torch

import commlib
import commlib.parallel.layers as layers
import commlib.parallel.shard as shard
from commlib.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_cross_entropy,
    shard_model,
)

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("one_thread_per_rank")]

MODEL_CASES = {1: 60, 2: 40, 3: 30, 4: 25}   # per group size, at each world size
VOCAB_CASES = {1: 60, 2: 40, 3: 30, 4: 25}
SCALE = float(os.environ.get("DIFF_CASES_SCALE", "1"))  # more cases for a soak run
ACTS = [torch.nn.ReLU, torch.nn.Tanh, torch.nn.GELU, torch.nn.Identity]


def close(a, b):
    # float64; AdamW and BatchNorm amplify the order of the tensor-parallel sums a little
    return torch.allclose(a.detach(), b.detach(), rtol=1e-9, atol=1e-10, equal_nan=True)


def gathered(t, group):
    return layers._gather_last(t.detach().contiguous(), group)


def rejected(problems):
    """Whether any rank found a problem (agreed on every rank)."""
    return bool(commlib.allreduce(np.array([len(problems)]))[0])


@pytest.fixture(scope="module")
def tp_groups():
    """(size, tp group of this rank) for every size dividing the world."""
    n = commlib.get_world_size()
    topos = [commlib.Topology(tp=k) for k in range(1, n + 1) if n % k == 0]
    yield [(t.sizes["tp"], t.group("tp")) for t in topos]
    for t in topos:
        t.free()


# -- shard_model ------------------------------------------------------------------------

@dataclasses.dataclass
class ModelCase:
    seed: int
    lm: bool
    tied: bool
    min_params: int
    optimizer: str
    steps: list          # zero_grad before each step

    def __str__(self):
        return (f"model case seed={self.seed} lm={self.lm} tied={self.tied} "
                f"min_params={self.min_params} opt={self.optimizer} steps={self.steps}")


def model_case(seed, force_tied=False):
    rng = np.random.default_rng(seed)
    lm = force_tied or bool(rng.random() < 0.4)
    return ModelCase(seed, lm, force_tied or (lm and bool(rng.random() < 0.6)),
                     int(rng.choice([1, 8, 30])), str(rng.choice(["sgd", "adamw"])),
                     [bool(rng.random() < 0.7) for _ in range(int(rng.integers(2, 4)))])


def linear(rng, win, wout):
    lin = torch.nn.Linear(win, wout, bias=bool(rng.random() < 0.8)).double()
    if rng.random() < 0.15:
        lin.weight.requires_grad_(False)
    if lin.bias is not None and rng.random() < 0.2:
        lin.bias.requires_grad_(False)
    return lin


def build_model(case):
    """The case's unsharded model, its input width (or vocabulary) and output width."""
    rng = np.random.default_rng(case.seed + 1)
    torch.default_generator.manual_seed(case.seed)
    mods, square = [], {}
    w0 = w = int(rng.integers(1, 9))
    vocab = int(rng.integers(3, 12))
    if case.lm:
        mods.append(torch.nn.Embedding(vocab, w).double())
    for _ in range(int(rng.integers(1, 6))):
        r = rng.random()
        if r < 0.45:
            w2 = int(rng.integers(1, 9))
            mods.append(linear(rng, w, w2))
            if w2 == w:
                square.setdefault(w, mods[-1])
            w = w2
            if rng.random() < 0.6:
                mods.append(ACTS[int(rng.integers(len(ACTS)))]())
        elif r < 0.6:
            mods.append(ACTS[int(rng.integers(len(ACTS)))]())
        elif r < 0.7 and not case.lm:
            mods.append(torch.nn.BatchNorm1d(w).double())
        elif r < 0.85:
            w2, w3 = (int(v) for v in rng.integers(1, 9, size=2))
            mods.append(torch.nn.Sequential(linear(rng, w, w2), torch.nn.Tanh(),
                                            linear(rng, w2, w3)))
            w = w3
        elif w in square:  # the same Linear at a second place
            mods.append(square[w])
        else:
            mods.append(linear(rng, w, w))
            square[w] = mods[-1]
    if case.lm:
        if w != w0:
            mods.append(linear(rng, w, w0))
        head = torch.nn.Linear(w0, vocab, bias=False).double()
        if case.tied:
            head.weight = mods[0].weight
        mods.append(head)
        w = vocab
    return torch.nn.Sequential(*mods), (vocab if case.lm else w0), w


def model_data(case, step, width, out):
    g = torch.Generator().manual_seed(case.seed * 100 + step)
    if case.lm:
        return torch.randint(0, width, (3, 4), generator=g), \
            torch.randint(0, out, (3, 4), generator=g)
    return (torch.randn(6, width, generator=g, dtype=torch.float64),
            torch.randn(6, out, generator=g, dtype=torch.float64))


def model_loss(case, y, t):
    if case.lm:
        return torch.nn.functional.cross_entropy(y.reshape(-1, y.shape[-1]), t.reshape(-1))
    return torch.nn.functional.mse_loss(y, t)


def optimizer(name, params):
    params = list(params)
    if not params:  # (a model of activations only)
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)
    # eps=1e-3: the first steps divide by |grad| + eps, ill-conditioned for grads near
    # a tiny eps, where the order of the sums (which differs by design) would show
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, eps=1e-3)


def compare_model(what, model, ref, group, problems):
    """Every parameter (and grad) and buffer of ``model`` against ``ref``, module by
    module (collective over ``group`` for the sharded layers)."""
    mods = dict(model.named_modules())
    for path, rm in ref.named_modules():
        mm = mods[path]
        if isinstance(mm, (ColumnParallelLinear, RowParallelLinear)):
            pairs = [("weight", mm.full_weight(), rm.weight,
                      None if mm.weight.grad is None else
                      (gathered(mm.weight.grad.t(), group).t()
                       if isinstance(mm, ColumnParallelLinear)
                       else gathered(mm.weight.grad, group)), mm.weight.grad is None)]
            if mm.bias is not None:
                col = isinstance(mm, ColumnParallelLinear)
                pairs.append(("bias", gathered(mm.bias, group) if col else mm.bias, rm.bias,
                              None if mm.bias.grad is None else
                              (gathered(mm.bias.grad, group) if col else mm.bias.grad),
                              mm.bias.grad is None))
        else:
            own = dict(mm.named_parameters(recurse=False))
            pairs = [(n, own[n], p, own[n].grad, own[n].grad is None)
                     for n, p in rm.named_parameters(recurse=False)]
            bufs = dict(mm.named_buffers(recurse=False))
            for n, b in rm.named_buffers(recurse=False):
                if not close(bufs[n].double(), b.double()):
                    problems.append(f"{what} {path}.{n} (buffer) differs")
        for name, value, want, grad, no_grad in pairs:
            if not close(value, want):
                problems.append(f"{what} {path}.{name} differs by "
                                f"{(value.detach() - want.detach()).abs().max().item():.3g}")
            if no_grad != (want.grad is None):
                problems.append(f"{what} {path}.{name}.grad is "
                                f"{'None' if no_grad else 'a tensor'}, one process: "
                                f"{'None' if want.grad is None else 'a tensor'}")
            elif grad is not None and not close(grad, want.grad):
                problems.append(f"{what} {path}.{name}.grad differs")


def run_model_case(case, group):
    ref, width, out = build_model(case)
    model = shard_model(copy.deepcopy(ref), group, min_params=case.min_params)
    problems = []
    if case.tied:
        head = list(model)[-1]
        if type(head) is not torch.nn.Linear or head.weight is not list(model)[0].weight:
            problems.append(f"the tied head became {type(head).__name__} with its own weight")
    opt, ref_opt = optimizer(case.optimizer, model.parameters()), \
        optimizer(case.optimizer, ref.parameters())
    for step, zero in enumerate(case.steps):
        if zero:
            opt.zero_grad()
            ref_opt.zero_grad()
        x, t = model_data(case, step, width, out)
        y, want = model(x), ref(x)
        if not close(y, want):
            problems.append(f"step {step}: output differs by "
                            f"{(y - want).abs().max().item():.3g}")
        loss, ref_loss = model_loss(case, y, t), model_loss(case, want, t)
        if loss.requires_grad:
            loss.backward()
        if ref_loss.requires_grad:
            ref_loss.backward()
        opt.step()
        ref_opt.step()
        compare_model(f"step {step}", model, ref, group, problems)
    return problems  # (no early exit: the ranks of the group stay in step)


def test_shard_model_matches_one_process(tp_groups):
    n = commlib.get_world_size()
    total = 0
    for k, group in tp_groups:
        for i in range(int(MODEL_CASES.get(n, 20) * SCALE)):
            case = model_case(10000 * n + 1000 * k + i)
            problems = run_model_case(case, group)
            if rejected(problems):
                raise AssertionError(f"rank {commlib.get_rank()} (tp group of {k}): {case}: "
                                     f"{problems[:4] or 'failed on another rank'}")
            total += 1
    print(f"\n{total} shard_model cases at {n} ranks (group sizes "
          f"{[k for k, _ in tp_groups]})")


def test_shard_model_negative_controls(tp_groups, monkeypatch):
    """The old planner (ties ignored) and sharded layers that drop requires_grad=False
    must be rejected."""
    count = 0
    for k, group in tp_groups:
        for i in range(3):
            case = dataclasses.replace(model_case(500 + 10 * k + i, force_tied=True),
                                       min_params=1)
            monkeypatch.setattr(shard, "_shared", lambda model: set())
            problems = run_model_case(case, group)
            monkeypatch.undo()
            assert rejected(problems), f"untying shard_model not rejected: {case}"
            count += 1
        # a frozen Linear the planner shards, whose shards forget that it is frozen
        for seed in range(700 + 1000 * k, 1700 + 1000 * k):
            case = model_case(seed)
            ref, _, _ = build_model(case)
            plan = shard._Plan(ref, group, case.min_params)
            if any(type(m) is torch.nn.Linear and not m.weight.requires_grad and
                   plan.column(m) for m in ref.modules()):
                break
        else:
            raise AssertionError("no generated model with a frozen shardable Linear")
        monkeypatch.setattr(layers, "_keep_frozen", lambda layer, source: None)
        problems = run_model_case(case, group)
        monkeypatch.undo()
        assert rejected(problems), f"sharded layers losing requires_grad not rejected: {case}"
        count += 1
    print(f"\n{count} shard_model negative controls rejected")


# -- VocabParallelEmbedding + parallel_cross_entropy ---------------------------------------

@dataclasses.dataclass
class VocabCase:
    seed: int
    vocab: int
    dim: int
    padding_idx: object
    max_norm: object
    norm_type: float
    ids_shape: tuple
    ignore_index: int
    reduction: str
    smoothing: float
    bad: str             # "", "ids" or "target": an out-of-range value the step must refuse
    steps: int

    def __str__(self):
        return "vocab case " + ", ".join(f"{k}={v}" for k, v in
                                         dataclasses.asdict(self).items())


def vocab_case(seed, k, **force):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(k, k + 12))
    c = VocabCase(seed, vocab, int(rng.integers(1, 6)),
                  int(rng.integers(-vocab, vocab)) if rng.random() < 0.5 else None,
                  float(rng.uniform(0.3, 2.0)) if rng.random() < 0.4 else None,
                  float(rng.choice([1.0, 2.0, 3.0])),
                  (int(rng.integers(1, 9)),) if rng.random() < 0.5 else
                  (int(rng.integers(1, 4)), int(rng.integers(1, 5))),
                  -100 if rng.random() < 0.6 else int(rng.integers(0, vocab)),
                  str(rng.choice(["mean", "mean", "sum", "none"])),
                  float(rng.choice([0.0, 0.0, 0.1, 0.3, 1.0])),
                  str(rng.choice(["", "", "", "", "", "", "", "", "ids", "target"])),
                  int(rng.integers(1, 4)))
    return dataclasses.replace(c, **force)


def vocab_data(case, step):
    rng = np.random.default_rng(case.seed * 10 + step)
    ids = rng.integers(0, case.vocab, size=case.ids_shape)
    target = rng.integers(0, case.vocab, size=case.ids_shape)
    if case.padding_idx is not None:
        ids[rng.random(case.ids_shape) < 0.3] = case.padding_idx % case.vocab
    target[rng.random(case.ids_shape) < (0.3 if rng.random() < 0.9 else 1.0)] = \
        case.ignore_index
    if case.bad:
        arr = ids if case.bad == "ids" else target
        value = int(rng.choice([case.vocab, case.vocab + 5, -1]))
        if case.bad == "target" and value == case.ignore_index:
            value = case.vocab
        arr.reshape(-1)[int(rng.integers(arr.size))] = value
    g = torch.Generator().manual_seed(case.seed * 10 + step)
    return (torch.from_numpy(ids), torch.from_numpy(target),
            torch.randn(case.ids_shape, generator=g, dtype=torch.float64))


def reference_loss(case, logits, target):
    if logits.dim() > 2:  # torch puts the classes at dim 1
        logits = logits.movedim(-1, 1)
    return torch.nn.functional.cross_entropy(logits, target, ignore_index=case.ignore_index,
                                             reduction=case.reduction,
                                             label_smoothing=case.smoothing)


def run_vocab_case(case, group, tamper=None, loss_fn=parallel_cross_entropy):
    torch.default_generator.manual_seed(case.seed)
    emb = torch.nn.Embedding(case.vocab, case.dim, padding_idx=case.padding_idx,
                             max_norm=case.max_norm, norm_type=case.norm_type).double()
    head = torch.nn.Linear(case.dim, case.vocab).double()
    vemb = VocabParallelEmbedding.from_embedding(emb, group)
    col = ColumnParallelLinear.from_linear(head, group, gather_output=False)
    if tamper is not None:
        tamper(vemb)
    params = list(vemb.parameters()) + list(col.parameters())
    opt = torch.optim.SGD(params, lr=0.5)
    ref_opt = torch.optim.SGD(list(emb.parameters()) + list(head.parameters()), lr=0.5)
    sl = slice(vemb.start, vemb.start + vemb.local)
    problems = []
    for step in range(case.steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        ids, target, w = vocab_data(case, step)
        if case.bad:
            try:
                loss_fn(col(vemb(ids)), target, group, vocab_size=case.vocab,
                        ignore_index=case.ignore_index, reduction=case.reduction,
                        label_smoothing=case.smoothing)
                problems.append(f"out-of-range {case.bad} accepted")
            except IndexError as e:
                if f"'{case.bad}'" not in str(e) or f"[0, {case.vocab})" not in str(e):
                    problems.append(f"IndexError without the argument and range: {e}")
            break
        h, ref_h = vemb(ids), emb(ids)
        if not close(h, ref_h):
            problems.append(f"step {step}: embedding output differs")
        loss = loss_fn(col(h), target, group, vocab_size=case.vocab,
                       ignore_index=case.ignore_index, reduction=case.reduction,
                       label_smoothing=case.smoothing)
        ref = reference_loss(case, head(ref_h), target)
        if loss.shape != ref.shape:  # (the same on every rank)
            problems.append(f"step {step}: loss shape {loss.shape} != {ref.shape}")
            break
        if not close(loss, ref):
            problems.append(f"step {step}: loss {loss.tolist()} != {ref.tolist()}")
        if case.reduction == "none":
            loss, ref = (loss * w).sum(), (ref * w).sum()
        loss.backward()
        ref.backward()
        if not close(vemb.weight.grad, emb.weight.grad[sl]):
            problems.append(f"step {step}: embedding gradient differs")
        head_grad = gathered(col.weight.grad.t(), group).t()
        if not close(head_grad, head.weight.grad):
            problems.append(f"step {step}: head gradient differs")
        opt.step()
        ref_opt.step()
        full = col.full_weight()  # (collective: outside any short-circuit)
        if not close(vemb.weight, emb.weight[sl]) or not close(full, head.weight):
            problems.append(f"step {step}: weights differ after the step")
    return problems  # (no early exit on a local problem: the ranks stay in step)


def test_vocab_layers_match_torch(tp_groups):
    n = commlib.get_world_size()
    total = refused = 0
    for k, group in tp_groups:
        for i in range(int(VOCAB_CASES.get(n, 20) * SCALE)):
            case = vocab_case(20000 * n + 1000 * k + i, k)
            problems = run_vocab_case(case, group)
            if rejected(problems):
                raise AssertionError(f"rank {commlib.get_rank()} (tp group of {k}): {case}: "
                                     f"{problems[:4] or 'failed on another rank'}")
            total += 1
            refused += bool(case.bad)
    print(f"\n{total} vocab cases at {n} ranks ({refused} out-of-range, refused)")


def counting_ignored(logits, target, group, vocab_size, ignore_index, reduction,
                     label_smoothing):
    """A cross-entropy that counts the ignored targets (as class 0)."""
    target = torch.where(target == ignore_index, torch.zeros_like(target), target)
    return parallel_cross_entropy(logits, target, group, vocab_size, -12345, reduction,
                                  label_smoothing)


def test_vocab_negative_controls(tp_groups):
    count = 0
    for k, group in tp_groups:
        for i in range(3):
            base = vocab_case(900 + 10 * k + i, k, bad="", steps=2, ids_shape=(8,))
            base = dataclasses.replace(base, vocab=max(base.vocab, 3))
            controls = [
                ("cross-entropy counting ignored targets",
                 dataclasses.replace(base, ignore_index=-100), None, counting_ignored),
                ("embedding ignoring padding_idx",
                 dataclasses.replace(base, padding_idx=1, max_norm=None),
                 lambda m: setattr(m, "padding_idx", None), parallel_cross_entropy),
                ("embedding ignoring max_norm",
                 dataclasses.replace(base, max_norm=0.3, dim=max(base.dim, 2)),
                 lambda m: setattr(m, "max_norm", None), parallel_cross_entropy),
            ]
            for what, case, tamper, fn in controls:
                problems = run_vocab_case(case, group, tamper, fn)
                assert rejected(problems), f"negative control not rejected: {what}: {case}"
                count += 1
    print(f"\n{count} vocab negative controls rejected")
