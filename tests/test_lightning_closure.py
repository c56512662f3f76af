"""``optimizer.step(closure)``, the way Lightning (and LBFGS) steps: the closure's backward
makes the step's gradients inside ``step()``, so an algorithm's before-step work (the
averaged weights of ``decentralized``, K-FAC's preconditioning, qadam's momentum...) must
run after the closure, not before it. Every algorithm trains bit for bit as with
``closure(); optimizer.step()`` (positional and keyword closures, float64, one process).
Before this was handled, ``decentralized`` under Lightning never moved from its initial
weights (each step restored the snapshot taken before the previous update)."""
import pytest

torch = pytest.importorskip("torch")

import commlib  # noqa: E402
from commlib.algorithms.qadam import QAdamOptimizer  # noqa: E402

CASES = [("gradient_allreduce", {}), ("bytegrad", {}), ("local_sgd", {"sync_every": 2}),
         ("decentralized", {}), ("low_precision_decentralized", {}),
         ("async_model_average", {}), ("qadam", {"warmup_steps": 2}), ("d_kfac", {}),
         ("dp_kfac", {})]


def train(algorithm, kwargs, style):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 2)).double()
    initial = torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])
    ddp = commlib.DistributedDataParallel(net, algorithm=algorithm, **kwargs)
    opt = (QAdamOptimizer(ddp.parameters(), lr=0.01) if algorithm == "qadam" else
           torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.5))
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(5):
            x = torch.randn(8, 4, generator=g, dtype=torch.float64)

            def closure():
                opt.zero_grad()
                loss = ddp(x).square().mean()
                loss.backward()
                return loss

            if style == "plain":
                closure()
                opt.step()
            elif style == "positional":
                opt.step(closure)
            else:
                opt.step(closure=closure)
    finally:
        ddp.close()
    return initial, torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def test_closure_steps_train_as_plain_steps():
    for algorithm, kwargs in CASES:
        initial, plain = train(algorithm, kwargs, "plain")
        assert not torch.equal(initial, plain), f"{algorithm}: did not train"
        for style in ("positional", "keyword"):
            _, stepped = train(algorithm, kwargs, style)
            assert torch.equal(stepped, plain), \
                f"{algorithm}, step({style} closure): differs by " \
                f"{(stepped - plain).abs().max().item():.3g} from closure(); step()"
