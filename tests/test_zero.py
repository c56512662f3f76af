"""commlib.ZeroRedundancyOptimizer (ZeRO stage 1) against single-process training on the
whole batch: float64, 1e-10, each replica checked after every step, beside commlib DDP and
alone; a variant that never gathers the updated shards must be rejected by the same check."""
import io

import pytest

torch = pytest.importorskip("torch")

import commlib  # noqa: E402
from sharded_common import (  # noqa: E402
    OPTIMIZERS,
    TOL,
    check_replicas,
    data,
    flat,
    loss_fn,
    make_model,
    reference_optimizer,
    replica_errors,
    two_groups,
)

STEPS = 6


def world():
    return commlib.get_rank(), commlib.get_world_size()


def zero_optimizer(model, name):
    cls, kw, split = OPTIMIZERS[name]
    params = two_groups(list(model.named_parameters())) if split else model.parameters()
    return commlib.ZeroRedundancyOptimizer(params, cls, **kw)


def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            commlib.allreduce(p.grad, commlib.ReduceOp.AVG)


def train(name, with_ddp, steps=STEPS, broken=False):
    """(per-step verdicts, zero optimizer, reference model, reference optimizer)."""
    rank, n = world()
    ref = make_model()
    ref_opt = reference_optimizer(ref, name)
    model = make_model()
    ddp = commlib.DistributedDataParallel(model) if with_ddp else None
    opt = zero_optimizer(model, name)
    if broken:
        opt._gather_parameters = lambda: None   # negative control: shards never gathered
    history = []
    try:
        for step in range(steps):
            x, y = data(step, n)
            mine = slice(rank * 3, rank * 3 + 3)
            opt.zero_grad()
            loss_fn(ddp if with_ddp else model, x[mine], y[mine]).backward()
            if not with_ddp:
                average_gradients(model)
            opt.step()
            ref_opt.zero_grad()
            loss_fn(ref, x, y).backward()
            ref_opt.step()
            history.append(replica_errors(flat(model.parameters()), flat(ref.parameters())))
    finally:
        if ddp is not None:
            ddp.close()
    return history, opt, ref, ref_opt, model


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["sgd_momentum", "adamw_two_groups"])   # adam: alone
def test_parity_beside_ddp(name, one_thread_per_rank):
    history, opt, *_ = train(name, with_ddp=True)
    check_replicas(history)
    # each rank holds the state of its shard only
    n = commlib.get_world_size()
    owned = sum(len(g["params"]) for g in opt.optim.param_groups)
    total = sum(len(g["params"]) for g in opt.param_groups)
    assert owned < total or n == 1


@pytest.mark.mpi
def test_parity_alone(one_thread_per_rank):
    history, *_ = train("adam", with_ddp=False)
    check_replicas(history)


@pytest.mark.mpi
def test_negative_control_never_gathered_is_rejected(one_thread_per_rank):
    if commlib.get_world_size() == 1:
        pytest.skip("one rank owns every shard: nothing to gather")
    history, *_ = train("sgd_momentum", with_ddp=False, steps=3, broken=True)
    with pytest.raises(AssertionError):
        check_replicas(history)


@pytest.mark.mpi
def test_state_dict_is_the_full_state_and_loads_at_any_size(one_thread_per_rank):
    """consolidate_state_dict + state_dict equals the single-process optimizer's state;
    the reference's full state loads into a fresh ZeRO optimizer (this world size) and
    training continues in step with the reference."""
    rank, n = world()
    history, opt, ref, ref_opt, model = train("adamw_two_groups", with_ddp=False, steps=4)
    check_replicas(history)
    opt.consolidate_state_dict(to=n - 1)
    if rank == n - 1:
        full, expected = opt.state_dict(), ref_opt.state_dict()
        assert full["param_groups"] == expected["param_groups"]
        assert sorted(full["state"]) == sorted(expected["state"])
        for i, st in expected["state"].items():
            for key, value in st.items():
                torch.testing.assert_close(full["state"][i][key], value, rtol=0, atol=TOL)
    else:
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            opt.state_dict()
    # resume: the reference's state (through a file) into a new optimizer over a copy
    buf = io.BytesIO()
    torch.save({"model": ref.state_dict(), "opt": ref_opt.state_dict()}, buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    model2 = make_model(seed=99)
    model2.load_state_dict(saved["model"])
    opt2 = zero_optimizer(model2, "adamw_two_groups")
    opt2.load_state_dict(saved["opt"])
    out = []
    for step in range(4, 7):
        x, y = data(step, n)
        opt2.zero_grad()
        loss_fn(model2, x[rank * 3:rank * 3 + 3], y[rank * 3:rank * 3 + 3]).backward()
        average_gradients(model2)
        opt2.step()
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        ref_opt.step()
        out.append(replica_errors(flat(model2.parameters()), flat(ref.parameters())))
    check_replicas(out)


@pytest.mark.mpi
def test_add_param_group_and_scheduler(one_thread_per_rank):
    """A param group added later is sharded too; an lr scheduler on the wrapper reaches the
    local optimizer."""
    rank, n = world()
    ref, model = make_model(), make_model()
    head_ref = list(ref.head.parameters())
    body_ref = [p for name, p in ref.named_parameters() if not name.startswith("head")]
    head = list(model.head.parameters())
    body = [p for name, p in model.named_parameters() if not name.startswith("head")]
    ref_opt = torch.optim.SGD(body_ref, lr=0.1, momentum=0.5)
    opt = commlib.ZeroRedundancyOptimizer(body, torch.optim.SGD, lr=0.1, momentum=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 2, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    history = []
    for step in range(5):
        if step == 2:
            ref_opt.add_param_group({"params": head_ref, "lr": 0.05})
            opt.add_param_group({"params": head, "lr": 0.05})
        x, y = data(step, n)
        opt.zero_grad()
        loss_fn(model, x[rank * 3:rank * 3 + 3], y[rank * 3:rank * 3 + 3]).backward()
        average_gradients(model)
        opt.step()
        sched.step()
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        ref_opt.step()
        ref_sched.step()
        history.append(replica_errors(flat(model.parameters()), flat(ref.parameters())))
    check_replicas(history)
    assert opt.optim.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def test_bad_arguments():
    model = make_model()
    with pytest.raises(TypeError, match="optimizer_class"):
        commlib.ZeroRedundancyOptimizer(model.parameters(), "adam", lr=0.1)
    with pytest.raises(ValueError, match="overlap_with_ddp"):
        commlib.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD,
                                        overlap_with_ddp=True, lr=0.1)
    with pytest.raises(TypeError, match="group"):
        commlib.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, group=3, lr=0.1)


@pytest.mark.mpi
def test_param_groups_have_the_optimizer_defaults_and_the_state_loads_into_torch(
        one_thread_per_rank):
    """param_groups hold the wrapped optimizer's defaults from construction on (and after
    add_param_group), as torch's ZeroRedundancyOptimizer does; the consolidated state dict
    loads into a plain torch.optim.Adam, which then steps like the reference."""
    rank, n = world()
    model, ref = make_model(), make_model()
    body = [p for name, p in model.named_parameters() if not name.startswith("head")]
    opt = commlib.ZeroRedundancyOptimizer(body, torch.optim.Adam, lr=0.01)
    plain = torch.optim.Adam(body, lr=0.01).param_groups[0]
    assert {k: v for k, v in opt.param_groups[0].items() if k != "params"} == \
        {k: v for k, v in plain.items() if k != "params"}
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    opt.add_param_group({"params": list(model.head.parameters()), "betas": (0.5, 0.9)})
    assert opt.param_groups[1]["betas"] == (0.5, 0.9) and opt.param_groups[1]["eps"] == 1e-8
    ref_opt = torch.optim.Adam([p for name, p in ref.named_parameters()
                                if not name.startswith("head")], lr=0.01)
    ref_opt.add_param_group({"params": list(ref.head.parameters()), "betas": (0.5, 0.9)})
    history = []
    for step in range(2):
        x, y = data(step, n)
        opt.zero_grad()
        loss_fn(model, x[rank * 3:rank * 3 + 3], y[rank * 3:rank * 3 + 3]).backward()
        average_gradients(model)
        opt.step()
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        ref_opt.step()
        history.append(replica_errors(flat(model.parameters()), flat(ref.parameters())))
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        sd = opt.state_dict()
        copy = make_model()
        copy.load_state_dict(model.state_dict())
        plain_opt = torch.optim.Adam([p for name, p in copy.named_parameters()
                                      if not name.startswith("head")], lr=0.01)
        plain_opt.add_param_group({"params": list(copy.head.parameters())})
        plain_opt.load_state_dict(sd)
        x, y = data(2, n)
        for m, o in ((copy, plain_opt), (ref, ref_opt)):
            o.zero_grad()
            loss_fn(m, x, y).backward()
            o.step()
        torch.testing.assert_close(flat(copy.parameters()), flat(ref.parameters()),
                                   rtol=0, atol=TOL)
    check_replicas(history)
    opt.close()


@pytest.mark.mpi
def test_close_frees_the_communicator(one_thread_per_rank):
    """3000 construct/close cycles (MPICH has about 2000 communicators): close() frees the
    private communicator; it is idempotent, the optimizer is a context manager, and a step
    after close raises."""
    if commlib.get_world_size() > 2:
        pytest.skip("1 and 2 ranks (CI time)")
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    for _ in range(3000):
        opt = commlib.ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)
        opt.close()
    opt.close()
    with commlib.ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1) as opt:
        params[0].grad = torch.ones(3, dtype=torch.float64)
        opt.step()
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
