"""A small commlib program that misbehaves on purpose; driven by test_faults.py.

Usage: python fault_program.py MODE. Rank 1 misbehaves; the other ranks go on calling
collectives (unless MODE says otherwise):

``skip``        alive but never joins the next collective
``raise``       raises RuntimeError (uncaught)
``exit``        ``sys.exit(3)``
``exit0``       ``sys.exit(0)``
``early``       its loop ends early (fewer batches) and its script ends normally
``exit_busy``   ``sys.exit(2)`` while the others compute alone for a minute (no collective)
``kill``        sends itself SIGKILL
``mismatch``    calls a different collective
``none``        no fault
``stagger``     no fault; rank r ends its script 3 r seconds after the last collective
``stagger_fail`` no fault, but rank 0 ends with ``sys.exit(1)`` right after the last
                collective and the others a second later with status 0

Every rank prints ``SHM [names]``: the MPICH shared-memory segments (``/dev/shm``) it maps,
so that the test can check that the job left none behind.
"""
import json
import os
import signal
import sys
import time

import numpy as np

import commlib
from helpers import mpich_segments


def main(mode: str) -> None:
    commlib.init()
    rank = commlib.get_rank()
    print(f"SHM {json.dumps(mpich_segments())}", flush=True)
    x = np.ones(1000)
    commlib.allreduce(x)  # everyone is up
    steps = 3
    if rank == 1:
        if mode == "skip":
            time.sleep(120)  # alive but never joins the next collective
        elif mode == "raise":
            raise RuntimeError("rank 1 failed on purpose")
        elif mode == "exit":
            sys.exit(3)
        elif mode == "exit0":
            sys.exit(0)
        elif mode == "exit_shm":   # the others make the shared-memory window meanwhile
            sys.exit(4)
        elif mode == "exit_busy":
            time.sleep(1)  # the others are computing by now
            sys.exit(2)
        elif mode == "early":
            steps = 1
        elif mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "mismatch":
            commlib.broadcast(np.ones(7))
    elif mode == "exit_busy":
        time.sleep(60)  # local work, no collective: rank 1 leaves meanwhile
    if mode == "exit_shm":   # 64 KiB: in COMMLIB_SHM=auto's range, the window's first use
        x = np.ones(8192)
    for _ in range(steps):
        commlib.allreduce(x)
    if mode == "early" and rank == 1:
        print(f"rank {rank}: ends early", flush=True)
        return
    commlib.barrier()
    print(f"rank {rank}: finished normally", flush=True)
    if mode == "stagger":
        time.sleep(3 * rank)  # local work after the last collective
    elif mode == "stagger_fail":
        if rank == 0:
            sys.exit(1)
        time.sleep(1)


if __name__ == "__main__":
    main(sys.argv[1])
