"""torch.distributed programs on their exit paths (run by test_torch_launch.py and
test_faults.py).

Without arguments: creates commlib and gloo process groups, uses asynchronous operations and
ends without destroy_process_group(): the job must still exit 0. A matched isend/irecv pair
nobody waits for is completed at exit, before MPI finalizes.

``raise_after_init``: after ``init_process_group("commlib")`` (which installs torch's
``_distributed_excepthook`` around commlib's hook) rank 1 raises while the others
all-reduce; the traceback must reach the job's stderr. ``raise_before_init``: rank 1
raises after ``import commlib``, before anything else, while the others wait for it in
torch's rendezvous (``init_process_group``). Every rank prints ``SHM [names]`` (see
helpers.mpich_segments).
"""
import atexit
import json
import os
import sys

import torch

MODE = sys.argv[1] if len(sys.argv) > 1 else None


def report() -> None:
    # Registered first, so it runs after commlib's own exit handlers.
    print(f"rank {rank} unwaited irecv at exit: {late_buffer.tolist()}, unwaited all_reduce "
          f"{never_waited.tolist()}", flush=True)


if MODE is None:
    atexit.register(report)
import torch.distributed as dist  # noqa: E402

import commlib  # noqa: F401,E402
from helpers import mpich_segments  # noqa: E402

print(f"SHM {json.dumps(mpich_segments())}", flush=True)
if MODE == "raise_before_init" and os.environ.get("RANK") == "1":
    raise RuntimeError("rank 1 failed on purpose before init")
dist.init_process_group("commlib")
rank, n = dist.get_rank(), dist.get_world_size()
if MODE == "raise_after_init":
    t = torch.ones(10)
    dist.all_reduce(t)
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose under torch's excepthook")
    for _ in range(10):
        dist.all_reduce(t)
    print(f"rank {rank} finished", flush=True)
    sys.exit(0)
if MODE == "raise_before_init":
    print(f"rank {rank} finished", flush=True)
    sys.exit(0)
gloo = dist.new_group(backend="gloo")
t = torch.ones(1000)
work = dist.all_reduce(t, async_op=True)
fut = dist.all_reduce(torch.ones(3), group=gloo, async_op=True).get_future()
right, left = (rank + 1) % n, (rank - 1) % n
got = torch.zeros(5)
sent = dist.isend(torch.full((5,), float(rank)), right)
received = dist.irecv(got, left)
received.wait()
sent.get_future().wait()
work.wait()
fut.wait()
assert t[0] == n and got[0] == left
never_waited = torch.ones(4)
dist.all_reduce(never_waited, async_op=True)     # completed by the progress thread
late_buffer = torch.zeros(2)
dist.irecv(late_buffer, left)                  # never waited on; handle dropped
late = dist.isend(torch.full((2,), 7.0), right)   # never waited on
print(f"rank {rank} finished", flush=True)
