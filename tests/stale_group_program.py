"""A torch script that destroys its gloo group after something imported
``torch.distributed.nn`` (building any torch optimizer does, through torch._dynamo), whose
default arguments keep the group alive: it reports torch's gloo threads at three moments
(run by test_torch_launch.py). Its first atexit handler is registered before commlib is
imported, so it runs after commlib's exit handler; the last one runs before it."""
import atexit
import os
import sys


def gloo_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sorted(n for n in names if n.startswith(("pt_gloo", "gloo", "pt_tcpstore")))


atexit.register(lambda: print(f"rank {os.environ['RANK']} after commlib's exit handler: "
                              f"{gloo_threads()}", flush=True))
import commlib  # noqa: E402,F401

# isort: split
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # loads torch.distributed.nn
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, dist.get_rank())
assert everyone == list(range(dist.get_world_size())), everyone
dist.destroy_process_group()
print(f"rank {os.environ['RANK']} after destroy_process_group: {gloo_threads()}", flush=True)
if sys.argv[1:] == ["show-before"]:
    atexit.register(lambda: print(f"rank {os.environ['RANK']} before commlib's exit handler: "
                                  f"{gloo_threads()}", flush=True))
