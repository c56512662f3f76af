"""A small commlib program that misbehaves on purpose; driven by test_faults.py.

Usage: python fault_program.py MODE. Rank 1 misbehaves (MODE: skip, raise, exit, kill,
mismatch); the other ranks go on calling collectives. Used under mpiexec with a short
COMMLIB_TIMEOUT: the whole job must end non-zero within seconds.
"""
import os
import signal
import sys
import time

import numpy as np

import commlib


def main(mode: str) -> None:
    commlib.init()
    rank = commlib.get_rank()
    x = np.ones(1000)
    commlib.allreduce(x)  # everyone is up
    if rank == 1:
        if mode == "skip":
            time.sleep(120)  # alive but never joins the next collective
        elif mode == "raise":
            raise RuntimeError("rank 1 failed on purpose")
        elif mode == "exit":
            sys.exit(3)
        elif mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "mismatch":
            commlib.broadcast(np.ones(7))
    for _ in range(3):
        commlib.allreduce(x)
    commlib.barrier()
    print(f"rank {rank}: finished normally", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
