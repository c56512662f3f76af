"""A torch.distributed script that never imports commlib, for ``mpiexec -n N``: it asks for
the ``commlib`` backend by name (torch's ``torch.backends`` entry point registered it) with
the default ``env://`` rendezvous and no variables set (the entry point lets commlib set
them from MPI), then uses it. Prints ``AUTOLOAD {json}`` per rank."""
import json
import sys

import torch
import torch.distributed as dist

seen = {"commlib_at_import": "commlib" in sys.modules, "mpi_at_import": "mpi4py.MPI" in sys.modules,
        "registered": "commlib" in dist.Backend.backend_list,
        "cpu_default": dist.Backend.default_device_backend_map.get("cpu")}
dist.init_process_group("commlib")
rank, size = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)], dtype=torch.float64)
dist.all_reduce(t)
evens = dist.new_group(list(range(0, size, 2)), backend="commlib")
u = torch.ones(1)
if rank % 2 == 0:
    dist.all_reduce(u, group=evens)
gathered = [None] * size
dist.all_gather_object(gathered, rank)
seen.update(rank=rank, size=size, sum=t.item(), evens=u.item(), gathered=gathered,
            group=type(dist.group.WORLD).__name__, commlib_after="commlib" in sys.modules)
dist.destroy_process_group()
print("\nAUTOLOAD " + json.dumps(seen), flush=True)
