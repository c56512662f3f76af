"""Exit paths and resume of the ZeRO++ options (qwZ, qgZ int8/int4, hierarchical qgZ,
hpZ, all together; SHARD_GRAD_OP with qgZ) against FULL_SHARD, in one job.

* ``nan``: at step 1 one rank's gradient gets a NaN in one element (a hook on its first
  chunk). The NaN reaches the shard gradients of the rank that owns that element (with
  qgZ: of the element's block); each rank skips its optimizer step when its own shard
  gradients are not finite (GradScaler-style). Every option must end as FULL_SHARD does:
  the same ranks skip, nothing hangs, training goes on (parameters change after the
  fault), replicas identical and finite.
* ``step_raises``: at step 1 ``optimizer.step`` raises on one rank (its closure raises
  before any update); the loop catches it and goes on; the same checks.
  Before commlib's fix, both faults hung: SHARD_GRAD_OP re-gathered only the chunks whose
  shard changed on this rank, hpZ gathered a chunk over the node when this rank's shard
  was unchanged, so the rank that skipped entered other collectives than the rest.
* The exact options (hpZ, and SHARD_GRAD_OP's schedule) end bitwise at FULL_SHARD's (or
  SHARD_GRAD_OP + qgZ at FULL_SHARD + qgZ's) values under each fault.
* resume: the full model and optimizer state saved after 2 steps and loaded into a fresh
  wrapper with the same options continues 2 steps bitwise as the uninterrupted run.
"""
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import commlib  # noqa: E402
from sharded_common import loss_fn, make_model  # noqa: E402

FSDP = commlib.FullyShardedDataParallel
CHUNK_MB = 0.0005
BLOCK = 16
FAULT_STEP = 1
STEPS = 3
H = {"gradient_hierarchy": "node"}
CONFIGS = {
    "FULL_SHARD": ("FULL_SHARD", {}),
    "qwZ int8": ("FULL_SHARD", {"weight_quantization": "int8"}),
    "qgZ int8": ("FULL_SHARD", {"gradient_quantization": "int8"}),
    "qgZ int4 hierarchical": ("FULL_SHARD", {"gradient_quantization": "int4", **H}),
    "hpZ": ("FULL_SHARD", {"secondary_shard": "node"}),
    "qwZ + qgZ int4 hierarchical + hpZ": ("FULL_SHARD", {
        "weight_quantization": "int8", "gradient_quantization": "int4",
        "secondary_shard": "node", **H}),
    "SHARD_GRAD_OP + qgZ int8": ("SHARD_GRAD_OP", {"gradient_quantization": "int8"}),
}
#: config -> the config whose values it must equal bitwise
EXACT = {"hpZ": "FULL_SHARD", "SHARD_GRAD_OP + qgZ int8": "qgZ int8"}


def wrap(name, seed=3):
    strategy, kw = CONFIGS[name]
    return FSDP(make_model(seed), strategy, chunk_size_mb=CHUNK_MB,
                quantization_block_size=BLOCK, **kw)


def batch(step):
    rank = commlib.get_rank()
    g = torch.Generator().manual_seed(3000 + 100 * step + rank)
    return torch.randn(3, 10, generator=g, dtype=torch.float64), \
        torch.randint(0, 4, (3,), generator=g)


def full(model):
    return torch.cat([v.reshape(-1) for v in model.state_dict().values()])


def train(name, fault=None, steps=STEPS):
    """(final full state, ranks' skipped/failed steps [per rank], changed after fault)."""
    rank, n = commlib.get_rank(), commlib.get_world_size()
    bad = rank == n - 1
    model = wrap(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    skipped, after = [], None
    try:
        for step in range(steps):
            x, y = batch(step)
            opt.zero_grad()
            hook = None
            if fault == "nan" and bad and step == FAULT_STEP:
                def poison(g):
                    g = g.clone()
                    g[0] = float("nan")
                    return g
                hook = model._chunks[0].full.register_hook(poison)
            loss_fn(model, x, y).backward()
            if hook is not None:
                hook.remove()
            if not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()
                       if p.grad is not None):
                skipped.append(step)
            elif fault == "step_raises" and bad and step == FAULT_STEP:
                def closure():
                    raise RuntimeError("closure failed on purpose")
                with pytest.raises(RuntimeError, match="on purpose"):
                    opt.step(closure)
                skipped.append(step)
            else:
                opt.step()
            if step == FAULT_STEP:
                after = full(model).clone()
        state = full(model)
        changed = not torch.equal(after, state)
    finally:
        model.close()
    flags = commlib.allgather(np.array([int(s in skipped) for s in range(steps)]))
    return state, [list(np.flatnonzero(r)) for r in flags], changed


def identical(t):
    rows = commlib.allgather(t.numpy())
    return all(np.array_equal(r, rows[0]) for r in rows)


def nodes(n):
    return 2 if n == 4 else 1   # 2 x 2 at 4 ranks, else one rank a node


@pytest.mark.mpi
def test_faults_end_as_for_full_shard(monkeypatch, one_thread_per_rank):
    n = commlib.get_world_size()
    monkeypatch.setattr(commlib.options, "local_size", nodes(n))
    problems = []
    for fault in ("nan", "step_raises"):
        runs = {name: train(name, fault) for name in CONFIGS}
        ref_state, ref_skips, _ = runs["FULL_SHARD"]
        for name, (state, skips, changed) in runs.items():
            where = f"{fault} / {name}"
            if skips != ref_skips:
                problems.append(f"{where}: ranks skipped {skips}, FULL_SHARD {ref_skips}")
            if not changed:
                problems.append(f"{where}: training stopped after the fault")
            if not bool(torch.isfinite(state).all()) or not identical(state):
                problems.append(f"{where}: final parameters not finite or not identical")
            if name in EXACT and not torch.equal(state, runs[EXACT[name]][0]):
                problems.append(f"{where}: differs from {EXACT[name]}")
        if n > 1 and not any(ref_skips):
            problems.append(f"{fault}: no rank skipped in FULL_SHARD (the fault missed)")
    assert not problems, "; ".join(problems)


@pytest.mark.mpi
def test_resume_mid_training_is_exact(monkeypatch, one_thread_per_rank):
    n = commlib.get_world_size()
    monkeypatch.setattr(commlib.options, "local_size", nodes(n))
    problems = []
    for name in CONFIGS:
        model = wrap(name)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        saved = None
        for step in range(4):
            if step == 2:
                buf = io.BytesIO()
                torch.save({"model": model.state_dict(),
                            "optim": FSDP.optim_state_dict(model, opt)}, buf)
                saved = buf.getvalue()
            x, y = batch(step)
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            opt.step()
        uninterrupted = full(model)
        model.close()
        state = torch.load(io.BytesIO(saved), weights_only=False)
        model = wrap(name, seed=42)   # other initial values: the load must replace them
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        model.load_state_dict(state["model"])
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, state["optim"]))
        for step in range(2, 4):
            x, y = batch(step)
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            opt.step()
        if not torch.equal(full(model), uninterrupted):
            problems.append(f"{name}: the resumed run differs from the uninterrupted one")
        model.close()
    assert not problems, "; ".join(problems)
