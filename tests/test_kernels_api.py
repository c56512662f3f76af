"""Package-level behaviour: lazy GPU imports, implementation choice, the simulator run."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from commlib import kernels

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra):
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_import_does_not_pull_in_gpu_libraries_or_torch():
    code = ("import sys; from commlib import kernels; "
            "print(sorted(m for m in ('numba.cuda', 'cupy', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _cuda_usable():
    try:
        from numba import cuda
        return cuda.is_available()
    except Exception:
        return False


@pytest.mark.skipif(_cuda_usable(), reason="a GPU or the simulator is available here")
@pytest.mark.parametrize("call", [
    lambda x: kernels.quantize_minmax_uint8(x, 4, impl="cuda"),
    lambda x: kernels.compress_sign(x, np.zeros_like(x), 4, impl="cuda"),
    lambda x: kernels.dequantize_minmax_uint8(kernels.quantize_minmax_uint8(x, 4),
                                              impl="cuda"),
    lambda x: kernels.quantize_minmax_uint8(x[:0], 4, impl="cuda"),
])
def test_requesting_cuda_without_a_gpu_says_what_to_install(call):
    with pytest.raises((ImportError, RuntimeError), match=re.escape("pip install 'commlib[cuda]'")):
        call(np.ones(10, np.float32))


def test_unknown_impl_is_rejected():
    with pytest.raises(ValueError, match="impl must be"):
        kernels.quantize_minmax_uint8(np.ones(4, np.float32), 4, impl="gpu")


def test_decompress_dispatches_on_the_header():
    x = np.linspace(-3, 3, 100, dtype=np.float32)
    q = kernels.quantize_minmax_uint8(x, 32)
    assert np.array_equal(kernels.decompress(q), kernels.dequantize_minmax_uint8(q))
    s = kernels.compress_sign(x, np.zeros_like(x), 32)
    assert np.array_equal(kernels.decompress(s), kernels.decompress_sign(s))


# test_kernels_cudasim.py runs under NUMBA_ENABLE_CUDASIM=1 in gpu_check.py's kernels_cudasim
# stage, which test_gpu_check.py's dry run runs (and requires to pass) in the suite.
