"""A script for ``python -m commlib`` that reports, as one ``PROBE {json}`` line, what it sees
(it never imports commlib): ``sys.argv``, ``__name__``, ``sys.path[0]``, the class behind
torch's ``DistributedDataParallel`` names, the algorithm of a wrapper built without one,
the backend ``init_process_group()`` chose, whether its own classes pickle. Then it exits
with the status given by ``PROBE_EXIT`` or raises ``PROBE_RAISE``'s message."""
import json
import os
import pickle
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.parallel.distributed import DistributedDataParallel as LightningsDDP


class Local:
    def __init__(self, value):
        self.value = value


def backend_class():
    """The class of the process group behind the default group's CPU tensors."""
    world = dist.group.WORLD
    try:
        return type(world._get_backend(torch.device("cpu"))).__name__
    except RuntimeError:  # a Python ProcessGroup is its own backend
        return type(world).__name__


def main():
    dist.init_process_group()
    model = DDP(torch.nn.Linear(3, 2))
    explicit = DDP(torch.nn.Linear(3, 2), algorithm="gradient_allreduce")
    report = {
        "argv": sys.argv, "name": __name__, "path0": sys.path[0],
        "ddp": f"{DDP.__module__}.{DDP.__qualname__}", "same_class": DDP is LightningsDDP,
        "is_torch_ddp": isinstance(model, torch.nn.parallel.DistributedDataParallel),
        "algorithm": model.algorithm.name, "algorithm_repr": repr(model.algorithm),
        "explicit": explicit.algorithm.name,
        "backend": backend_class(),
        "default_backend": dist.get_default_backend_for_device(torch.device("cpu")),
        "pickled": pickle.loads(pickle.dumps(Local(5))).value,
        "accelerate_use_cpu": os.environ.get("ACCELERATE_USE_CPU"),
    }
    del model, explicit
    dist.destroy_process_group()
    print("PROBE " + json.dumps(report), flush=True)
    if os.environ.get("PROBE_RAISE"):
        raise RuntimeError(os.environ["PROBE_RAISE"])
    sys.exit(int(os.environ.get("PROBE_EXIT", "0")))


if __name__ == "__main__":
    main()
