"""An Accelerate training loop on commlib, checked step by step against torch's DDP over
gloo in the same job (float64), under ``mpiexec -n 2``:

* ``python accelerate_program.py recipe``: the one-edit recipe, ``init_process_group(
  "commlib")`` before ``Accelerator()`` (no ``cpu=True``): Accelerate wraps the model in
  torch's DDP over commlib's backend;
* ``python -m commlib accelerate_program.py runner``: the loop as Accelerate users write it
  (no commlib line in it), under the runner: Accelerate's ``prepare`` builds commlib's DDP.

Both check that ``Accelerator()`` is distributed (``MULTI_CPU``, every rank) and records
the backend of torch's default group (``accelerator.state.backend``; ``gather`` works with
it), that the parameters equal the reference's after every step (a negative control, the
same loop with one step's exchange skipped through ``accelerator.no_sync``, must not), and
that ``unwrap_model``/``save_model`` see through commlib's wrapper (keys without
``module.``). Each rank prints ``ACCELERATE {json}``.

* ``python -m commlib --algorithm local_sgd --algorithm-config '{"sync_every": 1000}'
  accelerate_program.py relaxed``: replicas that differ (each rank's measured, float64,
  gathered) when Accelerate saves: ``save_model`` and ``save_state`` must write their
  average (negative control: Accelerate's own ``save_model``, unpatched, writes rank 0's
  replica); ``get_state_dict`` on the main process only (no collective) returns that
  rank's replica and warns once (``RelaxedReplicaWarning``), the averaging saves do not.
  Each rank prints ``RELAXED {json}``.
"""
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

MODE = sys.argv[1]
if MODE == "recipe":
    dist.init_process_group("commlib")  # the one edit

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

STEPS = 6


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2)).double()


def loader():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * STEPS * 2, 5, generator=g, dtype=torch.float64)
    y = torch.randn(4 * STEPS * 2, 2, generator=g, dtype=torch.float64)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def step(model, opt, x, y, backward):
    opt.zero_grad()
    backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()


def main():
    accelerator = Accelerator()
    if MODE == "runner":
        from commlib.run.patch import TORCH_DDP  # the test's reference: torch's own class
    else:
        TORCH_DDP = torch.nn.parallel.DistributedDataParallel
    gloo = dist.new_group(backend="gloo")
    model = accelerator.prepare(net())
    opt, data = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1), loader())
    ref = TORCH_DDP(net(), process_group=gloo)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    broken = accelerator.prepare(net())
    broken_opt = accelerator.prepare(torch.optim.SGD(broken.parameters(), lr=0.1))
    diffs, broken_diffs = [], []
    for i, (x, y) in enumerate(data):
        step(model, opt, x, y, accelerator.backward)
        step(ref, ref_opt, x, y, lambda loss: loss.backward())
        if i == 2:
            with accelerator.no_sync(broken):
                step(broken, broken_opt, x, y, accelerator.backward)
        else:
            step(broken, broken_opt, x, y, accelerator.backward)
        diffs.append(max((a - b).abs().max().item()
                         for a, b in zip(model.parameters(), ref.parameters())))
        broken_diffs.append(max((a - b).abs().max().item()
                                for a, b in zip(broken.parameters(), ref.parameters())))
    unwrapped = accelerator.unwrap_model(model)
    directory = os.path.join(os.environ.get("ACCELERATE_PROGRAM_ROOT", tempfile.gettempdir()),
                             MODE)
    accelerator.save_model(model, directory, safe_serialization=False)
    accelerator.wait_for_everyone()
    saved = sorted(torch.load(os.path.join(directory, "pytorch_model.bin")))
    import commlib  # only to check unwrap_model on a wrapper built by hand
    mine = commlib.DistributedDataParallel(net())
    explicit = {"unwrapped": accelerator.unwrap_model(mine) is mine.module,
                "keys": sorted(accelerator.get_state_dict(mine))}
    print("\nACCELERATE " + json.dumps({
        "mode": MODE, "rank": accelerator.process_index, "processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "multi_cpu": accelerator.distributed_type == DistributedType.MULTI_CPU,
        "backend": dist.get_backend(), "state_backend": accelerator.state.backend,
        "gathered": accelerator.gather(torch.tensor([accelerator.process_index])).tolist(),
        "wrapper": f"{type(model).__module__}.{type(model).__name__}",
        "steps": len(diffs), "diffs": diffs, "broken_diffs": broken_diffs,
        "unwrapped": unwrapped is not model and not isinstance(unwrapped, TORCH_DDP),
        "saved_keys": saved, "explicit": explicit}), flush=True)
    dist.destroy_process_group()


def flat(tensors):
    return torch.cat([t.detach().double().reshape(-1) for t in tensors])


def relaxed():
    """See the module docstring (``relaxed``)."""
    import warnings

    from commlib.ddp import RelaxedReplicaWarning
    accelerator = Accelerator()
    model = accelerator.prepare(net())
    opt, data = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1), loader())
    batches = iter(data)  # never to the epoch's end: no sync point of the runner's
    root = os.environ.get("ACCELERATE_PROGRAM_ROOT", tempfile.gettempdir())
    names = [n for n, _ in model.module.named_parameters()]
    rank = accelerator.process_index

    def train(k):
        for _ in range(k):
            x, y = next(batches)
            step(model, opt, x, y, accelerator.backward)

    def replicas():
        """Every rank's replica, measured on its rank (rows: ranks)."""
        return accelerator.gather(flat(model.module.parameters())[None])

    def saved(path):
        state = torch.load(path)
        return flat(state[n] for n in names)

    def diff(a, b):
        return (a - b).abs().max().item()

    out = {"rank": rank, "algorithm": model.algorithm.name}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def warned():
            found = [w for w in caught if issubclass(w.category, RelaxedReplicaWarning)]
            del caught[:]
            return [str(w.message) for w in found]

        train(3)
        apart = replicas()
        out["spread"] = diff(apart[0], apart[1])
        if accelerator.is_main_process:  # the usual gating: must not be a collective
            own = flat(accelerator.get_state_dict(model)[n] for n in names)
            out["get_state_dict_vs_own"] = diff(own, apart[rank])
        accelerator.wait_for_everyone()
        out["warned_get_state_dict"] = warned()
        # Negative control: Accelerate's own save_model, without commlib's averaging.
        control = os.path.join(root, "relaxed_control")
        type(accelerator).save_model.__wrapped__(accelerator, model, control,
                                                 safe_serialization=False)
        accelerator.wait_for_everyone()
        out["warned_control"] = len(warned())
        model._replica_warned = False  # so that a warning from the saves below shows
        out["control_vs_mean"] = diff(saved(os.path.join(control, "pytorch_model.bin")),
                                      apart.mean(0))
        out["control_vs_rank0"] = diff(saved(os.path.join(control, "pytorch_model.bin")),
                                       apart[0])
        directory = os.path.join(root, "relaxed_model")
        accelerator.save_model(model, directory, safe_serialization=False)
        accelerator.wait_for_everyone()
        out["save_model_vs_mean"] = diff(saved(os.path.join(directory, "pytorch_model.bin")),
                                         apart.mean(0))
        after = replicas()
        out["spread_after_save"] = diff(after[0], after[1])
        train(3)
        apart = replicas()
        out["spread_2"] = diff(apart[0], apart[1])
        directory = os.path.join(root, "relaxed_state")
        accelerator.save_state(directory, safe_serialization=False)
        accelerator.wait_for_everyone()
        out["save_state_vs_mean"] = diff(saved(os.path.join(directory, "pytorch_model.bin")),
                                         apart.mean(0))
        out["warned_saves"] = warned()
    print("\nRELAXED " + json.dumps(out), flush=True)


if __name__ == "__main__":
    relaxed() if MODE == "relaxed" else main()
