"""Reader for the IDX file format of (Fashion-)MNIST.

Layout: two zero bytes, one byte element type, one byte number of dimensions ``ndim``, then
``ndim`` big-endian uint32 sizes, then the elements in C order, big-endian. The file may be
gzip-compressed; that is detected from the gzip magic bytes ``1f 8b``, not from the file name
(torchvision keeps both forms, some mirrors drop the ``.gz`` suffix).

Every problem is reported as a one-line :class:`~corrnoise.errors.CorrnoiseError` whose
parameter is the file path.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from pathlib import Path

import numpy as np

from ..errors import CorrnoiseError

__all__ = ["IDX_TYPES", "read_idx"]

#: IDX element-type byte -> big-endian numpy dtype.
IDX_TYPES: dict[int, str] = {
    0x08: ">u1",
    0x09: ">i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}
GZIP_MAGIC = b"\x1f\x8b"


def _raw_bytes(path: Path) -> bytes:
    name = str(path)
    if not path.exists():
        raise CorrnoiseError(name, "file not found")
    if not path.is_file():
        raise CorrnoiseError(name, "is not a regular file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CorrnoiseError(name, f"cannot be read ({exc.strerror or exc})") from None
    if data[:2] == GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise CorrnoiseError(name, f"corrupt or truncated gzip data ({exc}); fetch the file again") from None
    return data


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """The array stored in the IDX file ``path`` (gzip or plain), in native byte order.

    uint8 files give uint8 arrays; the other element types give int8/int16/int32/float32/float64.
    Raises :class:`CorrnoiseError` naming the file when it is missing, is not IDX (wrong magic
    number), has an unknown element type, or holds more or fewer bytes than its header declares.
    """
    path = Path(path)
    name = str(path)
    data = _raw_bytes(path)
    if len(data) < 4:
        raise CorrnoiseError(name, f"too short for an IDX header ({len(data)} bytes); the file is truncated or empty")
    if data[0] != 0 or data[1] != 0:
        magic = int.from_bytes(data[:4], "big")
        raise CorrnoiseError(name, f"not an IDX file (magic number 0x{magic:08x}, expected 0x0000TTDD)")
    code, ndim = data[2], data[3]
    if code not in IDX_TYPES:
        known = ", ".join(f"0x{c:02x}" for c in IDX_TYPES)
        raise CorrnoiseError(name, f"unknown IDX element type 0x{code:02x} (known: {known})")
    if ndim == 0:
        raise CorrnoiseError(name, "IDX header declares 0 dimensions; the file is corrupt")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise CorrnoiseError(name, f"truncated IDX header: {ndim} dimensions need {header} bytes, file has {len(data)}")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(IDX_TYPES[code])
    count = math.prod(shape)
    expected = count * dtype.itemsize
    found = len(data) - header
    if found < expected:
        raise CorrnoiseError(
            name, f"truncated: shape {shape} needs {expected} data bytes, found {found}; fetch the file again")
    if found > expected:
        raise CorrnoiseError(
            name, f"{found - expected} unexpected bytes after the data of shape {shape}; the file is corrupt")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="))
