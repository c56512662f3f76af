"""Creates commlib and gloo process groups, uses asynchronous operations and ends without
destroy_process_group(): the job must still exit 0 (run by test_torch_launch.py).
A matched isend/irecv pair nobody waits for is completed at exit, before MPI finalizes."""
import atexit

import torch


def report() -> None:
    # Registered first, so it runs after commlib's own exit handlers.
    print(f"rank {rank} unwaited irecv at exit: {late_buffer.tolist()}, unwaited all_reduce "
          f"{never_waited.tolist()}", flush=True)


atexit.register(report)
import commlib  # noqa: F401,E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("commlib")
gloo = dist.new_group(backend="gloo")
rank, n = dist.get_rank(), dist.get_world_size()
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
