"""One task of an ``srun`` step of test_slurm.py: checks the MPI world, the torch backend
and replica identity on every rank, then (``--digits``) runs the digits example.

    srun -n 4 [--mpi=none|pmi2] python slurm_program.py store|pmi [--digits ARGS...]

``store``: ``srun --mpi=none`` (no PMI server: commlib forms the world from a TCPStore on
the step's first node); ``pmi``: ``srun --mpi=pmi2`` (Slurm's PMI server; MPICH's PMI-1
client talks to it, commlib forms nothing). Checks, each an AssertionError on the rank:

* ``MPI.COMM_WORLD`` is Slurm's task (``SLURM_PROCID`` of ``SLURM_STEP_NUM_TASKS``), the
  shared-memory node is the step's tasks on this node, and the world is the expected kind;
* ``init_process_group("commlib")`` (env://, from the variables commlib set) has Slurm's
  rank and size; its ``all_reduce`` (float64 and a 1 Mi-element float32) equals the sum
  computed locally from every rank's data; ``all_gather`` returns every rank's tensor;
* torch's ``DistributedDataParallel`` over the commlib group, 4 steps on rank-specific
  data: every rank's parameters' checksum is the same and equals a float64 full-batch
  reference computed locally; negative control: the same model stepped without DDP has
  checksums that differ between ranks (so the comparison can fail);
* ``--digits ARGS``: ``commlib.examples.train_digits`` runs as ``python -m`` would run it,
  with ``ARGS``; its replicas' parameter checksums, taken when it calls ``average_parameters()``
  (before that averages them), are the same on every rank.

Prints ``slurm task R of N ok ...`` on every rank.
"""
import hashlib
import os
import runpy
import sys

import commlib

# isort: split
import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

expect = sys.argv[1]
env = os.environ
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
want = (int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]))
assert (rank, size) == want, f"MPI rank/size {(rank, size)} != Slurm's {want}"
world = commlib.mpi.launch.current()
if expect == "store":
    assert world is not None, commlib.mpi.launch.why_not()
    assert "PMI_FD" not in env and env["MASTER_ADDR"] == env["SLURM_STEP_NODELIST"].split(",")[0]
else:  # pmi: Slurm's PMI-2 server (PMI_FD) or its PMIx server (PMIX_RANK): MPI's own world
    assert world is None and any(v in (commlib.mpi.launch.why_not() or "")
                                 for v in ("PMI_FD", "PMIX_RANK")), commlib.mpi.launch.why_not()
node = comm.Split_type(MPI.COMM_TYPE_SHARED)
assert node.Get_size() == int(env["SLURM_STEP_TASKS_PER_NODE"].split("(")[0]), node.Get_size()
assert node.Get_rank() == int(env["SLURM_LOCALID"]), (node.Get_rank(), env["SLURM_LOCALID"])

torch.set_num_threads(1)
dist.init_process_group("commlib")
assert (dist.get_rank(), dist.get_world_size()) == (rank, size)
data = [torch.from_numpy(np.random.default_rng(r).standard_normal(1000)) for r in range(size)]
t = data[rank].clone()
dist.all_reduce(t)
assert torch.allclose(t, sum(data), rtol=1e-12, atol=1e-12), "all_reduce (float64) != sum"
big = torch.full((1 << 20,), float(rank + 1), dtype=torch.float32)
dist.all_reduce(big)
assert torch.equal(big, torch.full_like(big, size * (size + 1) / 2)), big[:4]
gathered = [torch.empty(1000, dtype=torch.float64) for _ in range(size)]
dist.all_gather(gathered, data[rank])
assert all(torch.equal(g, d) for g, d in zip(gathered, data)), "all_gather"


def checksum(module: torch.nn.Module) -> str:
    """Of the parameters (batch-norm running statistics differ between ranks after the
    last forward, as under torch's DDP: buffers are broadcast before each forward)."""
    digest = hashlib.sha256()
    for name, tensor in module.named_parameters():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def all_checksums(module: torch.nn.Module) -> list:
    out = [None] * size
    dist.all_gather_object(out, checksum(module))
    return out


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1)).double()


def batch(r: int, step: int) -> tuple:
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), \
        torch.randn(8, 1, generator=g, dtype=torch.float64)


ddp = torch.nn.parallel.DistributedDataParallel(make_model())
alone, reference = make_model(), make_model()
opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, alone, reference)]
for step in range(4):
    x, y = batch(rank, step)
    for m, opt in zip((ddp, alone), opts):
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    opts[2].zero_grad()  # full batch: the mean of every rank's mean loss
    sum(torch.nn.functional.mse_loss(reference(bx), by)
        for bx, by in (batch(r, step) for r in range(size))).div(size).backward()
    opts[2].step()
for p, q in zip(ddp.module.parameters(), reference.parameters()):
    assert torch.allclose(p, q, rtol=1e-10, atol=1e-12), (p - q).abs().max()
replicas = all_checksums(ddp.module)
assert len(set(replicas)) == 1, f"torch DDP over commlib: replicas differ: {replicas}"
apart = all_checksums(alone)
assert len(set(apart)) == size, f"negative control: unsynchronized replicas agree: {apart}"
ddp_sum = replicas[0]

digits = ""
if "--digits" in sys.argv:
    seen: list = []
    original = commlib.DistributedDataParallel.average_parameters

    def average_parameters(self, *args, **kwargs):
        seen.append(all_checksums(self.module))
        return original(self, *args, **kwargs)

    commlib.DistributedDataParallel.average_parameters = average_parameters
    sys.argv = ["train_digits"] + sys.argv[sys.argv.index("--digits") + 1:]
    try:
        runpy.run_module("commlib.examples.train_digits", run_name="__main__", alter_sys=True)
    except SystemExit as exc:  # its `sys.exit(main())`
        assert exc.code in (0, None), f"train_digits exited with {exc.code}"
    assert len(seen) == 1 and len(set(seen[0])) == 1, f"train_digits replicas differ: {seen}"
    digits = f" digits replicas {seen[0][0]}"

dist.destroy_process_group()
print(f"slurm task {rank} of {size} ok {expect} node {node.Get_rank()}/{node.Get_size()} "
      f"kvsname={world.kvsname if world else None} ddp replicas {ddp_sum}{digits}", flush=True)
