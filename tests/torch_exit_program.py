"""Creates commlib and gloo process groups, uses asynchronous operations and ends without
destroy_process_group(): the job must still exit 0 (run by test_torch_launch.py)."""
import torch
import commlib  # noqa: F401
import torch.distributed as dist

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
late = dist.isend(torch.ones(2), right)        # never waited on
pending = dist.irecv(torch.zeros(2), left)     # matched by the peer's late isend
print(f"rank {rank} finished", flush=True)
