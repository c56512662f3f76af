"""Run by tests/test_packaging.py under ``mpiexec -n 2`` with Hugging Face's ``kernels``
installed: their package is imported first (as transformers does), then commlib's
compressed allreduce (min-max uint8, bytegrad's exchange) and its int4 allreduce
(streaming_diloco's) run, each checked against the uncompressed allreduce within twice its
codec's rounding bound. With commlib's kernels at the top level, the name ``kernels`` was
one package or the other and the exchanges failed (``module 'kernels' has no attribute
'compressed_nbytes'``). Prints ``OK <rank>``."""
import importlib.metadata
import os

import kernels  # Hugging Face's, from the distribution named "kernels"
import numpy as np

hf = importlib.metadata.distribution("kernels")
assert os.path.samefile(kernels.__file__, hf.locate_file("kernels/__init__.py")), \
    f"the top-level kernels is not Hugging Face's: {kernels.__file__}"

import torch  # noqa: E402

import commlib  # noqa: E402
from commlib import ReduceOp  # noqa: E402
from commlib.algorithms import int4  # noqa: E402
from commlib.primitives import compressed_allreduce  # noqa: E402

CHUNK = 64
rank, n = commlib.get_rank(), commlib.get_world_size()
# whole chunks in every rank's part: chunk k holds elements [k * CHUNK, (k + 1) * CHUNK)
# in every rank's input and in the result
length = n * CHUNK * 16
xs = [np.random.default_rng(11 + r).standard_normal(length).astype(np.float32) * (r + 1)
      for r in range(n)]
exact = xs[rank].astype(np.float64)
commlib.allreduce(exact, op=ReduceOp.AVG)   # the uncompressed reference
assert np.allclose(exact, np.mean(np.array(xs, np.float64), axis=0))


def check(name: str, got: np.ndarray, levels: int) -> None:
    """Two quantizations (each rank's parts, then the reduced part), each off by at most
    half a level of its chunk's range: bounded here by a whole level of each."""
    spans = np.mean([np.ptp(x.reshape(-1, CHUNK), axis=1) for x in xs], axis=0)
    bound = (spans + np.ptp(exact.reshape(-1, CHUNK), axis=1)) / levels
    err = np.abs(got.astype(np.float64) - exact).reshape(-1, CHUNK).max(axis=1)
    assert (err <= bound).all(), f"{name}: error {err.max()} beyond its bound"
    assert err.max() > 0, f"{name}: no quantization error at all (not compressed?)"
    everyone = commlib.allgather(np.ascontiguousarray(got))
    assert (everyone == everyone[0]).all(), f"{name}: ranks differ"


x = xs[rank].copy()
compressed_allreduce(x, op=ReduceOp.AVG, method="minmax_uint8", chunk_size=CHUNK)
check("compressed_allreduce(minmax_uint8)", x, 255)

t = torch.from_numpy(xs[rank].copy())
assert int4._use_kernels(t, None), "int4 does not find commlib's kernels"
int4.allreduce(t, commlib.new_group(), chunk_size=CHUNK)
check("int4.allreduce", t.numpy(), 15)

print(f"OK {rank}", flush=True)
