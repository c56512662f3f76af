"""Wire layout of a compressed buffer: one contiguous, self-describing uint8 array.

Every compressed buffer starts with a 32-byte little-endian header::

    offset  size  field
         0     4  magic b"CLKC"
         4     1  version (1)
         5     1  kind: 1 = minmax_uint8, 2 = sign1, 3 = minmax_int4
         6     2  reserved, 0
         8     8  numel       uint64, elements of the original (flattened) input
        16     8  chunk_size  uint64, elements per chunk (the last chunk may be shorter)
        24     8  nbytes      uint64, total length of this buffer, padding included

followed by two sections; with ``nchunks = ceil(numel / chunk_size)``:

``minmax_uint8``
    offset 32: ``nchunks`` pairs of float32 ``(min, max)``;
    then ``numel`` uint8 codes, element ``i`` at byte ``i`` of the section.
``sign1``
    offset 32: ``nchunks`` float32 scales (mean |v| of the chunk);
    then the sign bits: chunk ``c`` starts at byte ``c * ceil(chunk_size / 8)`` of the
    section and occupies ``ceil(len_c / 8)`` bytes; element ``k`` of the chunk is bit
    ``k % 8`` (least significant bit first) of byte ``k // 8``; bit 1 means negative.
``minmax_int4`` (``chunk_size`` even)
    offset 32: ``nchunks`` pairs of float32 ``(min, max)``;
    then ``chunk_size / 2`` bytes per chunk, every chunk whole: chunk ``c`` starts at
    byte ``c * chunk_size / 2``; element ``k`` of the chunk is the low nibble of byte
    ``k // 2`` for even ``k``, the high nibble for odd ``k``. The last chunk's positions
    past ``numel`` hold the code of the last element (the chunk padded with its last
    value), so the two sections are exactly the wire format of
    ``commlib.algorithms.int4``.

The buffer is zero-padded to a multiple of 8 bytes, so pieces laid end to end (an
alltoall or allgather receive buffer) keep every header and float32 section aligned.
float32 values are IEEE-754 little-endian. The length depends only on
``(kind, numel, chunk_size)``, which is what fixed-size collectives need.
"""
from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ._arith import MAX_CHUNK_SIZE

MAGIC = b"CLKC"
VERSION = 1
HEADER_NBYTES = 32
ALIGN = 8

MINMAX_UINT8 = "minmax_uint8"
SIGN1 = "sign1"
MINMAX_INT4 = "minmax_int4"
_KIND_CODES = {MINMAX_UINT8: 1, SIGN1: 2, MINMAX_INT4: 3}
_KIND_NAMES = {code: name for name, code in _KIND_CODES.items()}
_PARAMS_PER_CHUNK = {MINMAX_UINT8: 2, SIGN1: 1, MINMAX_INT4: 2}

_HEADER = struct.Struct("<4sBBHQQQ")
assert _HEADER.size == HEADER_NBYTES


@dataclass(frozen=True)
class Layout:
    """Where everything lives in a compressed buffer of one ``(kind, numel, chunk_size)``.

    Derived sizes are cached: they are read several times per call on the hot path."""

    kind: str
    numel: int
    chunk_size: int

    @cached_property
    def nchunks(self) -> int:
        return -(-self.numel // self.chunk_size)

    @cached_property
    def params_shape(self) -> tuple[int, ...]:
        per = _PARAMS_PER_CHUNK[self.kind]
        return (self.nchunks, per) if per > 1 else (self.nchunks,)

    @cached_property
    def params_offset(self) -> int:
        return HEADER_NBYTES

    @cached_property
    def data_offset(self) -> int:
        return HEADER_NBYTES + 4 * _PARAMS_PER_CHUNK[self.kind] * self.nchunks

    @cached_property
    def bits_stride(self) -> int:
        """sign1 only: bytes from one chunk's sign bits to the next chunk's."""
        return -(-self.chunk_size // 8)

    @cached_property
    def data_nbytes(self) -> int:
        if self.kind == MINMAX_UINT8:
            return self.numel
        if self.kind == MINMAX_INT4:
            return self.nchunks * (self.chunk_size // 2)
        if self.nchunks == 0:
            return 0
        last = self.numel - (self.nchunks - 1) * self.chunk_size
        return (self.nchunks - 1) * self.bits_stride + -(-last // 8)

    @cached_property
    def nbytes(self) -> int:
        end = self.data_offset + self.data_nbytes
        return -(-end // ALIGN) * ALIGN


def check_chunk_size(chunk_size: Any) -> int:
    """``chunk_size`` as an int in ``[1, 2**24]``, or ``ValueError``/``TypeError``."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    if not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be in [1, {MAX_CHUNK_SIZE}], got {chunk_size}")
    return int(chunk_size)


def make_layout(kind: str, numel: int, chunk_size: int) -> Layout:
    if kind not in _KIND_CODES:
        raise ValueError(f"unknown kind {kind!r}; expected one of {sorted(_KIND_CODES)}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    chunk_size = check_chunk_size(chunk_size)
    if kind == MINMAX_INT4 and chunk_size % 2:
        raise ValueError(f"chunk_size must be even for {kind} (two codes per byte), "
                         f"got {chunk_size}")
    return Layout(kind, int(numel), chunk_size)


def pack_header(lay: Layout) -> np.ndarray:
    """The 32 header bytes of ``lay`` as a uint8 array."""
    if sys.byteorder != "little":
        raise RuntimeError("the compressed layout stores native float32; big-endian hosts "
                           "are not supported")
    raw = _HEADER.pack(MAGIC, VERSION, _KIND_CODES[lay.kind], 0, lay.numel, lay.chunk_size,
                       lay.nbytes)
    return np.frombuffer(raw, dtype=np.uint8).copy()


def parse_header(head: np.ndarray, buf_nbytes: int) -> Layout:
    """Validate the first 32 bytes of a buffer of ``buf_nbytes`` bytes; return its layout.

    Raises ``ValueError`` saying what is wrong (not a compressed buffer, unknown version
    or kind, or a length that disagrees with the header).
    """
    if buf_nbytes < HEADER_NBYTES:
        raise ValueError(f"compressed buffer too short: {buf_nbytes} bytes, the header "
                         f"alone is {HEADER_NBYTES}")
    magic, version, code, _, numel, chunk_size, nbytes = _HEADER.unpack(
        np.ascontiguousarray(head[:HEADER_NBYTES], dtype=np.uint8).tobytes())
    if magic != MAGIC:
        raise ValueError(f"not a commlib compressed buffer (magic {magic!r}, expected "
                         f"{MAGIC!r})")
    if version != VERSION:
        raise ValueError(f"compressed buffer version {version} is not supported "
                         f"(this build reads version {VERSION})")
    if code not in _KIND_NAMES:
        raise ValueError(f"compressed buffer has unknown kind code {code}")
    lay = make_layout(_KIND_NAMES[code], numel, chunk_size)
    if nbytes != lay.nbytes or buf_nbytes != lay.nbytes:
        raise ValueError(f"compressed buffer length mismatch: header says {nbytes} bytes, "
                         f"buffer has {buf_nbytes}, layout needs {lay.nbytes} for "
                         f"{lay.kind} numel={numel} chunk_size={chunk_size}")
    return lay


def sections(buf: Any, lay: Layout) -> tuple[Any, Any]:
    """(params float32 view, data uint8 view) of ``buf``.

    Works on anything that slices and reinterprets like numpy: numpy arrays and Numba
    device arrays (real or simulated).
    """
    params = buf[lay.params_offset:lay.data_offset].view(np.float32).reshape(lay.params_shape)
    data = buf[lay.data_offset:lay.data_offset + lay.data_nbytes]
    return params, data
