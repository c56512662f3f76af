"""A torchrun-style training script, unchanged except that it imports commlib: plain
``init_process_group()`` (env:// rendezvous), ``DistributedSampler``, torch's DDP, a
snapshot saved, loaded and trained on. Run by test_torch_launch.py under ``mpiexec``.

    python torch_env_program.py ORDER BACKEND SNAPSHOT_DIR
    ORDER: commlib-first | torch-first; BACKEND: default (no argument) | commlib | gloo
"""
import gc
import os
import sys

order, backend, snapshot_dir = sys.argv[1:4]
if order == "commlib-first":
    import commlib  # noqa: F401
    # isort: split
    import torch
else:
    import torch

    import commlib  # noqa: F401
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

torch.set_num_threads(1)
if backend == "default":
    dist.init_process_group()
else:
    dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                  "MASTER_ADDR", "MASTER_PORT")}
print(f"rank {rank} env {env}", flush=True)

g = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(40, 6, generator=g, dtype=torch.float64),
                        torch.randn(40, 2, generator=g, dtype=torch.float64))
sampler = DistributedSampler(dataset)
loader = DataLoader(dataset, batch_size=4, sampler=sampler)


def make():
    torch.manual_seed(1)
    net = DDP(torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                  torch.nn.Linear(16, 2)).double())
    return net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def train(net, opt, epochs):
    for epoch in epochs:
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()


def flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


model, opt = make()
train(model, opt, range(2))
path = os.path.join(snapshot_dir, "snapshot.pt")
if rank == 0:
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict()}, path)
dist.barrier()
resumed, opt2 = make()
state = torch.load(path, map_location="cpu")
resumed.module.load_state_dict(state["model"])
opt2.load_state_dict(state["opt"])
assert torch.equal(flat(resumed), flat(model)), "the snapshot did not restore the model"
train(model, opt, range(2, 4))
train(resumed, opt2, range(2, 4))
assert torch.equal(flat(resumed), flat(model)), "resumed training diverged"
replicas = [torch.zeros_like(flat(model)) for _ in range(world)]
dist.all_gather(replicas, flat(model))
assert all(torch.equal(r, replicas[0]) for r in replicas), "replicas differ between ranks"
print(f"rank {rank} of {world} ok backend={dist.get_backend_config()}", flush=True)
# DDP models that outlive destroy_process_group() make gloo abort at exit now and then
# ("terminate called without an active exception"; torch alone, without commlib, too): the
# usual order, models first.
del model, resumed, opt, opt2
gc.collect()
dist.destroy_process_group()
