"""Lazy access to ``numba.cuda``, with an error that says what to install.

Importing ``commlib.kernels`` never imports ``numba.cuda`` or ``cupy``; the CUDA kernel modules
call ``load_cuda()`` when they are first imported, which happens on the first call that
runs with ``impl="cuda"``.
"""
from __future__ import annotations

from types import ModuleType

CUDA_HINT = ("install the GPU extra: pip install 'commlib[cuda]' (brings cupy-cuda12x and "
             "numba-cuda)")


def load_cuda() -> ModuleType:
    """``numba.cuda``, usable (a GPU or ``NUMBA_ENABLE_CUDASIM=1``); raises otherwise."""
    try:
        from numba import cuda
    except ImportError as exc:
        raise ImportError(f"the CUDA kernels need numba's CUDA target, which is not "
                          f"importable; {CUDA_HINT}") from exc
    if not cuda.is_available():
        raise RuntimeError(f"the CUDA kernels found no usable CUDA GPU and driver; "
                           f"{CUDA_HINT}, or set NUMBA_ENABLE_CUDASIM=1 to run them on "
                           f"Numba's CPU simulator")
    return cuda
