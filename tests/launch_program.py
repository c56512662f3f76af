"""A job started by any launcher: checks the MPI world commlib formed, then trains.

    python launch_program.py EXPECT [--bench] [--crash-rank R]
    EXPECT: store (commlib formed a store-backed world) | mpi (mpiexec's world)

Checks, on every rank (an AssertionError fails the rank): ``MPI.COMM_WORLD`` is the
launcher's rank and size (torchrun's/Kubernetes' ``RANK``/``WORLD_SIZE``, Slurm's
``SLURM_PROCID``/``SLURM_NTASKS``), the shared-memory node is the launcher's local world,
mpi4py raises exceptions for MPI errors as after its own initialization, a commlib
allreduce equals numpy's sum of every rank's data, one step of commlib's
``DistributedDataParallel`` equals the full-batch step computed locally in float64 (and
is the same on every rank), ``init_process_group("commlib")`` (env://) and a gloo group
beside it reduce alike, and (store) the hooks a failure detector would use: the monitor
runs ``on_poll`` callbacks (every rank's beat reaches the store) and ranks added to
``world.dead`` are what ``MPIX_Comm_get_failed`` reports (``PMI_dead_processes``).
Prints ``rank R ok ...`` and leaves through a normal exit.

``--crash-rank R``: in the first attempt (``TORCHELASTIC_RESTART_COUNT=0``) rank R kills
itself with SIGKILL after the first allreduce (for torchrun ``--max-restarts``).
``--bench``: also times 16 MiB allreduces.
"""
import os
import sys
import time

T0 = time.time()
import commlib  # noqa: E402

# isort: split
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402


def say(line: str) -> None:
    """One line in one write(2): the workers of a launcher share its stdout, and print()'s
    separate writes of the text and the newline interleave between processes."""
    os.write(1, (line + "\n").encode())

expect = sys.argv[1]
bench = "--bench" in sys.argv
crash = int(sys.argv[sys.argv.index("--crash-rank") + 1]) if "--crash-rank" in sys.argv else -1
env = os.environ
world = commlib.mpi.launch.current()
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))

if "SLURM_PROCID" in env and "RANK" not in env:  # mpi_env publishes RANK later, at import
    want = (int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]))
else:
    want = (int(env["RANK"]), int(env["WORLD_SIZE"]))
assert (rank, size) == want, f"MPI rank/size {(rank, size)} != launcher's {want}"
assert (world is not None) == (expect == "store"), (expect, world, commlib.mpi.launch.why_not())
node = comm.Split_type(MPI.COMM_TYPE_SHARED)
want_local = env.get("EXPECT_LOCAL_SIZE") or env.get("LOCAL_WORLD_SIZE")
if want_local:
    assert node.Get_size() == int(want_local), (node.Get_size(), want_local)
if world is not None:
    assert (world.local_rank, world.local_size) == (node.Get_rank(), node.Get_size())
    assert "PMI_FD" not in env and env["COMMLIB_LAUNCH_PID"] == str(os.getpid())
    assert (env["PMI_RANK"], env["PMI_SIZE"]) == (str(rank), str(size))
assert comm.Get_errhandler() == MPI.ERRORS_RETURN, "mpi4py's rc.errors was not applied"
if world is not None:  # the monitor's poll hook (where a failure detector would beat)
    world.on_poll(lambda w: w.call("add", w.key(f"beat/{w.rank}"), 1))

commlib.init()
data = [np.random.default_rng(r).standard_normal(1000) for r in range(size)]
x = data[rank].copy()
commlib.allreduce(x)
first_allreduce = time.time()
assert np.allclose(x, np.sum(data, axis=0), rtol=1e-12, atol=1e-12), "allreduce != numpy"
say(f"rank {rank} attempt {attempt} kvsname={world.kvsname if world else None} "
      f"first allreduce at {first_allreduce:.3f} "
      f"boot_s {first_allreduce - T0:.3f}")
if rank == crash and attempt == 0:
    say(f"rank {rank} killing itself at {time.time():.3f}")
    os.kill(os.getpid(), 9)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
reference = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 1)).double()
reference.load_state_dict(net.state_dict())

def batch(r):
    g = torch.Generator().manual_seed(r)
    return (torch.randn(4, 5, dtype=torch.float64, generator=g),
            torch.randn(4, 1, dtype=torch.float64, generator=g))


batches = [batch(r) for r in range(size)]
ddp = commlib.DistributedDataParallel(net)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
torch.nn.functional.mse_loss(ddp(batches[rank][0]), batches[rank][1]).backward()
opt.step()
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
(sum(torch.nn.functional.mse_loss(reference(a), b) for a, b in batches) / size).backward()
ref_opt.step()
flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
assert torch.allclose(flat, expected, rtol=1e-12, atol=1e-12), "DDP step != full-batch step"
every = commlib.allgather(flat.numpy().copy())
assert all(np.array_equal(every[r], every[0]) for r in range(size)), "replicas differ"

dist.init_process_group("commlib")
gloo = dist.new_group(backend="gloo")
t = torch.arange(6, dtype=torch.float64) * (rank + 1)
a, b = t.clone(), t.clone()
dist.all_reduce(a)
dist.all_reduce(b, group=gloo)
assert torch.equal(a, b) and torch.equal(a, torch.arange(6.0, dtype=torch.float64)
                                         * size * (size + 1) / 2), (a, b)
assert dist.get_backend() == "commlib" and dist.get_backend(gloo) == "gloo"

if world is not None:
    import datetime
    world.call("wait", [world.key(f"beat/{r}") for r in range(size)],
               datetime.timedelta(seconds=30))
if world is not None and rank == 0:
    # The hook a failure detector uses: ranks in world.dead are what MPICH's
    # PMI_dead_processes answers, so MPIX_Comm_get_failed sees them.
    import ctypes
    world.dead.add(size - 1)
    lib = world._lib
    handle = ctypes.c_int(0)
    err = lib.MPIX_Comm_get_failed(ctypes.c_int(MPI._handleof(comm)), ctypes.byref(handle))
    failed = MPI.Group.fromhandle(handle.value & 0xFFFFFFFF)
    assert err == 0 and failed.Get_size() == 1, (err, failed.Get_size())
    assert MPI.Group.Translate_ranks(failed, [0], comm.Get_group()) == [size - 1]
    world.dead.clear()

if bench:
    big = np.ones(2 << 20)  # 16 MiB of float64
    times = []
    for _ in range(12):
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, big)
        times.append(time.perf_counter() - start)
    say(f"rank {rank} allreduce16MiB_ms {1000 * float(np.median(times[2:])):.2f} "
          + " ".join(f"{k} {v:.3f}" for k, v in (world.timings if world else {}).items()))

kvsname = world.kvsname if world is not None else "-"
dist.destroy_process_group()
say(f"rank {rank} of {size} ok kvsname={kvsname} local={node.Get_rank()}/{node.Get_size()}")
