"""Element types commlib carries, and how each maps onto MPI.

Every supported element type is a :class:`DType` entry: its name, the numpy dtype of a
zero-copy host view of the buffer, the MPI datatype used on the wire, and whether MPI can
reduce it natively. ``float16`` uses ``MPI_FLOAT16_T`` where the MPI library provides it
(MPICH 4.2 and newer); ``bfloat16`` (and ``float16`` elsewhere) travels as 16-bit words and
is reduced by user-defined MPI operations that widen each pair of operands to float32,
combine them and round back to nearest-even (see :mod:`commlib.base.reduce_ops`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

import numpy as np
from mpi4py import MPI


@dataclass(frozen=True)
class DType:
    name: str            # canonical name, as numpy/torch spell it ("float32", "bfloat16", ...)
    host: np.dtype       # dtype of the zero-copy numpy view handed to MPI
    mpi: Any             # MPI.Datatype on the wire
    kind: str            # "f" float, "i"/"u" integer, "c" complex, "b" bool
    native_reduce: bool  # MPI's predefined reduction ops accept ``mpi``

    @property
    def itemsize(self) -> int:
        return self.host.itemsize


def _native(name: str, mpi_type: Any, kind: str) -> DType:
    return DType(name, np.dtype(name), mpi_type, kind, True)


@cache
def _table() -> dict[str, DType]:
    # Built lazily: MPI datatype handles are only meaningful once MPI is initialized.
    t = {
        "bool": DType("bool", np.dtype(np.bool_), MPI.C_BOOL, "b", True),
        "int8": _native("int8", MPI.INT8_T, "i"),
        "int16": _native("int16", MPI.INT16_T, "i"),
        "int32": _native("int32", MPI.INT32_T, "i"),
        "int64": _native("int64", MPI.INT64_T, "i"),
        "uint8": _native("uint8", MPI.UINT8_T, "u"),
        "uint16": _native("uint16", MPI.UINT16_T, "u"),
        "uint32": _native("uint32", MPI.UINT32_T, "u"),
        "uint64": _native("uint64", MPI.UINT64_T, "u"),
        "float32": _native("float32", MPI.FLOAT, "f"),
        "float64": _native("float64", MPI.DOUBLE, "f"),
        "complex64": _native("complex64", MPI.C_FLOAT_COMPLEX, "c"),
        "complex128": _native("complex128", MPI.C_DOUBLE_COMPLEX, "c"),
        "bfloat16": DType("bfloat16", np.dtype(np.uint16), MPI.UINT16_T, "f", False),
    }
    f16 = getattr(MPI, "FLOAT16_T", MPI.DATATYPE_NULL)
    if f16 != MPI.DATATYPE_NULL:
        t["float16"] = DType("float16", np.dtype(np.float16), f16, "f", True)
    else:
        t["float16"] = DType("float16", np.dtype(np.float16), MPI.UINT16_T, "f", False)
    return t


def get(name: str) -> DType:
    """The entry for a canonical dtype name; ``KeyError`` if commlib cannot carry it."""
    return _table()[name]


def supported() -> list[str]:
    return sorted(_table())


@lru_cache(maxsize=64)
def from_numpy(dtype: np.dtype) -> DType | None:
    """Entry for a numpy dtype, ``None`` if unsupported (object, strings, datetimes...)."""
    name = np.dtype(dtype).name
    return _table().get(name)


@lru_cache(maxsize=64)
def from_torch(dtype: Any) -> DType | None:
    """Entry for a ``torch.dtype``, ``None`` if unsupported (quantized, complex32, ...)."""
    name = str(dtype).rsplit(".", 1)[-1]
    return _table().get(name)


# -- bfloat16 <-> float32 on 16-bit words (numpy has no bfloat16) -------------------------

def bf16_to_f32(words: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) to float32 exactly."""
    return (words.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 bit patterns, to nearest-even, NaN kept NaN (as torch does)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (((bits >> 16) & 1) + np.uint32(0x7FFF))) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return out
