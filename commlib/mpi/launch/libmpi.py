"""MPI initialization without the GIL, on the libmpi mpi4py loaded.

mpi4py initializes MPI while importing ``mpi4py.MPI``, holding the GIL; a PMI server that
is a thread of the same process could then never answer ``MPI_Init``. Instead commlib
sets ``mpi4py.rc.initialize = False``, imports ``mpi4py.MPI`` (which loads libmpi and
initializes nothing), calls ``MPI_Init_thread`` through ctypes (which releases the GIL for
the call) and then does what mpi4py does after its own initialization (error handlers
from ``rc.errors``). ``rc.finalize = True``: mpi4py finalizes MPI at exit as usual.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

_LEVELS = {"single": "THREAD_SINGLE", "funneled": "THREAD_FUNNELED",
           "serialized": "THREAD_SERIALIZED", "multiple": "THREAD_MULTIPLE"}


def import_mpi_uninitialized() -> Any:
    """``mpi4py.MPI``, imported with automatic initialization and finalization off.
    Raises RuntimeError if MPI is already initialized (``mpi4py.MPI`` was imported
    before, with mpi4py's defaults)."""
    import sys

    import mpi4py
    if "mpi4py.MPI" in sys.modules:
        MPI = sys.modules["mpi4py.MPI"]
        if MPI.Is_initialized():
            raise RuntimeError("MPI is already initialized (mpi4py.MPI was imported before "
                               "commlib, so each process is an MPI world of its own): "
                               "import commlib before mpi4py.MPI")
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = True  # at exit, as mpi4py does when it initialized MPI itself
    from mpi4py import MPI
    return MPI


def load(MPI: Any) -> ctypes.CDLL:
    """The libmpi that ``mpi4py.MPI`` is linked against (the same handle)."""
    path = None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                name = line.split(None, 5)[-1].strip() if line.count(" ") >= 5 else ""
                base = os.path.basename(name)
                if base.startswith(("libmpi.so", "libmpich.so")):
                    path = name
                    break
    except OSError:
        pass
    path = path or ctypes.util.find_library("mpi")
    if not path:
        raise RuntimeError("cannot find the libmpi that mpi4py loaded")
    lib = ctypes.CDLL(path)
    lib.MPI_Init_thread.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                    ctypes.POINTER(ctypes.c_int)]
    lib.MPI_Init_thread.restype = ctypes.c_int
    lib.MPI_Init.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.MPI_Init.restype = ctypes.c_int
    return lib


def initialize(MPI: Any, lib: ctypes.CDLL) -> int:
    """``MPI_Init_thread`` at the level mpi4py's ``rc`` asks for (``MPI_Init`` when
    ``rc.threads`` is false), without the GIL; returns the level provided."""
    import mpi4py
    rc = mpi4py.rc
    if not rc.threads:
        err = lib.MPI_Init(None, None)
        provided = MPI.THREAD_SINGLE
    else:
        level = getattr(MPI, _LEVELS.get(str(rc.thread_level).lower(), "THREAD_MULTIPLE"))
        out = ctypes.c_int(-1)
        err = lib.MPI_Init_thread(None, None, int(level), ctypes.byref(out))
        provided = out.value
    if err != 0:
        raise RuntimeError(f"MPI_Init_thread failed with MPI error code {err}")
    _set_errhandlers(MPI, rc)
    return provided


def _set_errhandlers(MPI: Any, rc: Any) -> None:
    """What mpi4py does after it initializes MPI itself (``rc.errors``, default
    ``"exception"``: MPI errors on ``COMM_SELF``/``COMM_WORLD`` raise ``MPI.Exception``
    instead of aborting)."""
    errors = str(getattr(rc, "errors", "exception")).lower()
    if errors == "exception":
        handler = MPI.ERRORS_RETURN
    elif errors == "abort":
        handler = MPI.ERRORS_ABORT if MPI.ERRORS_ABORT != MPI.ERRHANDLER_NULL \
            else MPI.ERRORS_ARE_FATAL
    elif errors == "fatal":
        handler = MPI.ERRORS_ARE_FATAL
    else:
        return
    MPI.COMM_SELF.Set_errhandler(handler)
    MPI.COMM_WORLD.Set_errhandler(handler)
