"""A program for test_node_shm_async's exit tests: a nonblocking allreduce through the
node's shared memory pending when a rank leaves.

    python node_shm_async_program.py nowait|exit1

``nowait``: every rank issues it and ends without ``wait()`` (the window's thread runs it
at exit, before MPI finalizes); ``exit1``: rank 1 calls ``sys.exit(1)`` after a blocking
allreduce, the others issue the nonblocking one and wait (the exit agreement must end the
job with rank 1's status instead of a hang). Each rank prints ``SHM [names]`` (its
segments), ``RESULT`` lines and, last thing before MPI finalizes, ``FREED rank <r>
<whether the world's window was freed>``."""
import json
import sys

import numpy as np

import commlib
from commlib.base.options import options
from commlib.mpi import shutdown
from commlib.primitives import node_shm
from helpers import shm_segments

options.shm = "1"
mode = sys.argv[1]
r, n = commlib.get_rank(), commlib.get_world_size()
x = np.full(1 << 20, r + 1.0, np.float32)
commlib.allreduce(x.copy())  # the window exists from here on
print("SHM " + json.dumps(shm_segments()), flush=True)
window = node_shm.window(commlib.world().comm)
# runs after commlib's own final steps (registered before): the window freed at a normal end
shutdown.at_final(lambda: print(f"FREED rank {r} {window.freed}", flush=True))
if mode == "exit1" and r == 1:
    sys.exit(1)
work = commlib.allreduce(x, async_op=True)
if mode == "nowait":
    print(f"RESULT rank {r} issued {node_shm.COUNTS['async']}", flush=True)
else:
    work.wait()
    print(f"RESULT rank {r} waited {x[0]}", flush=True)
