"""Two ranks: rank 1 sends 16 MiB messages to rank 0 without pause and is SIGKILLed after
1 s, mostly in the middle of one; rank 0 keeps receiving (``Irecv`` + ``Test``) for 4 s
and then prints ``receiver alive`` and how many messages it got. Under UCX's ``cma``
transport the receiver's copy out of the dead sender's memory fails and MPICH ends the
receiver; ``commlib`` imported first turns rendezvous inside a machine off in
fault-tolerant mode (``COMMLIB_FAULT_TOLERANT=1``, commlib.mpi.ucx_env). Run with one hydra
proxy per rank and ``-disable-auto-cleanup``."""
import os
import signal
import threading
import time

import commlib  # noqa: F401 (before mpi4py.MPI: chooses UCX's protocols)

# isort: split
import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
buf = np.ones(16 << 20, dtype=np.uint8)
if comm.Get_rank() == 1:
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    while True:
        comm.Send(buf, 0, 7)
else:
    got, end = 0, time.monotonic() + 4.0
    req = comm.Irecv(buf, 1, 7)
    while time.monotonic() < end:
        if req.Test():
            got += 1
            req = comm.Irecv(buf, 1, 7)
        else:
            time.sleep(1e-4)
    os.write(1, f"receiver alive: {got} messages, UCX_TLS={os.environ.get('UCX_TLS')} "
             f"UCX_RNDV_THRESH={os.environ.get('UCX_RNDV_THRESH')}\n"
             .encode())
    os._exit(0)
