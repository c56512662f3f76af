"""K-FAC (Kronecker-factored approximate curvature) for ``commlib.DistributedDataParallel``.

Two registered algorithms on one core:

* ``d_kfac`` (:class:`DKFAC`): factors allreduce-averaged, inverses computed by owners and
  shared, every rank preconditions every layer.
* ``dp_kfac`` (:class:`DPKFAC`): owners build factors from their local batch, invert and
  precondition their layers; only preconditioned gradients travel.

Modules: :mod:`.layers` (which layers, gradient matrices), :mod:`.factors` (capture, running
averages), :mod:`.inverses` (eigen/Cholesky, preconditioning), :mod:`.assignment` (owners),
:mod:`.kl_clip`, :mod:`.packing`, :mod:`.timers`, :mod:`.core` (the shared step).

Usage::

    # run: mpiexec -n 2
    import torch
    import commlib

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    x, y, loss_fn = torch.randn(32, 8), torch.randint(0, 2, (32,)), torch.nn.CrossEntropyLoss()

    ddp = commlib.DistributedDataParallel(model, algorithm="dp_kfac", damping=1e-3, lr=0.1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    loss_fn(ddp(x), y).backward()   # p.grad now holds the preconditioned gradient
    opt.step()
    print(ddp.algorithm.owners(), ddp.algorithm.second_order_bytes(), commlib.stats())
"""
from .core import KFAC
from .d_kfac import DKFAC
from .dp_kfac import DPKFAC

__all__ = ["DKFAC", "DPKFAC", "KFAC"]
