"""A GGUF file's metadata and tensor table, read compactly; the tensors stay in the memory map.

Written by hand because `gguf.GGUFReader` keeps a numpy memmap view for every part of every
string it parses: the 49,152 tokens and 48,900 merges of SmolLM2-135M's tokenizer cost
158 MiB of Python objects for a 94 MiB file (measured with VmRSS), more than the packed
model itself. Here strings are decoded once to `str` and number arrays become lists; only
the layout (the GGUF v2/v3 format) is ours, the type tables are the `gguf` package's.
Pages of a tensor are dropped from this process's resident set once it has been converted
(`release`), so the file is not held twice beside the packed weights.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any, NamedTuple

import numpy as np

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain numbers (the rest are blocks of bytes), as GGUFReader maps them.
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


class GGUFTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # ggml order: innermost dimension first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # read-only view of the map: numbers, or [rows, bytes per row] for blocks
    offset: int
    nbytes: int


class GGUFHeader:
    def __init__(self, path: str):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != b"GGUF":
            raise ValueError("GGUF magic invalid")
        self._order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
        version = self._get("I", 4)[0]
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not 2 or 3")
        n_tensors, n_fields = self._get("QQ", 8)
        self._pos = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._take("I")[0])
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = self._take("Q" * self._take("I")[0])
            kind, offset = self._take("IQ")
            infos.append((name, dims, kind, offset))
        align = int(self.fields.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors = [self._tensor(name, dims, kind, data_start + offset) for name, dims, kind, offset in infos]
        # The header's pages (SmolLM2's 49k tokenizer strings and merges: ~2 MiB) leave the resident
        # set once parsed into `fields`; they stay in the page cache.
        header_pages = data_start // mmap.PAGESIZE * mmap.PAGESIZE
        if header_pages:
            self._map.madvise(mmap.MADV_DONTNEED, 0, header_pages)

    def _get(self, fmt: str, pos: int) -> tuple:
        return struct.unpack_from(self._order + fmt, self._map, pos)

    def _take(self, fmt: str) -> tuple:
        values = self._get(fmt, self._pos)
        self._pos += struct.calcsize(self._order + fmt)
        return values

    def _string(self) -> str:
        (n,) = self._take("Q")
        raw = self._map[self._pos:self._pos + n]
        self._pos += n
        return raw.decode("utf-8", errors="surrogateescape")  # bad UTF-8 is reported where it is used

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            return self._take(_SCALARS[kind])[0]
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, n = self._take("IQ")
        if item in _SCALARS:  # one read for the whole array
            values = np.frombuffer(self._map, np.dtype(self._order + _SCALARS[item]), n, self._pos)
            self._pos += values.nbytes
            return values.tolist()
        return [self._value(item) for _ in range(n)]

    def _tensor(self, name: str, dims: tuple, kind: int, start: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        qtype = GGMLQuantizationType(kind)
        block, size = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims))
        nbytes = count * size // block
        shape = tuple(reversed(dims))
        plain = _PLAIN.get(qtype.name)
        if plain is not None:
            data = np.frombuffer(self._map, np.dtype(plain).newbyteorder(self._order), count, start).reshape(shape)
        else:
            data = np.frombuffer(self._map, np.uint8, nbytes, start).reshape(*shape[:-1], shape[-1] // block * size)
        return GGUFTensor(name, tuple(int(d) for d in dims), qtype, data, start, nbytes)

    def release(self, t: GGUFTensor, start: int = 0, stop: int | None = None) -> None:
        """Drop bytes [start, stop) of `t` from the resident set (they stay in the page cache;
        a later read faults them back): whole pages inside the range only."""
        page = mmap.PAGESIZE
        stop = t.nbytes if stop is None else stop
        start, stop = -(-(t.offset + start) // page) * page, (t.offset + stop) // page * page
        if stop > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, stop - start)
