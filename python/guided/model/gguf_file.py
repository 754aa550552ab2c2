"""Reading GGUF files: metadata and (dequantised) tensors.

The key/value section is parsed here directly rather than through
gguf.GGUFReader, which builds a numpy view per array element (seconds for a
150k-token vocabulary) and refuses files whose tensor data is cut short (the
metadata-only DeepSeek part). Dequantisation is the `gguf` package's.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")   # a string's byte count


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # torch order (outermost first)
    qtype: GGMLQuantizationType
    offset: int              # absolute, in the file


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary's hundreds of thousands: one tight loop)."""
        buf, pos, length, out = self.buf, self.pos, _LENGTH.unpack_from, []
        for _ in range(count):
            n = length(buf, pos)[0]
            out.append(buf[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"))
            pos += 8 + n
        self.pos = pos
        return out

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item == _STRING:
                return self.strings(count)
            if item == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            arr = np.frombuffer(self.buf, dtype=_NUMPY[item], count=count, offset=self.pos)
            self.pos += arr.nbytes
            return arr.tolist()
        return self.scalar(_SCALARS[kind])


class GGUFFile:
    """A parsed GGUF: `metadata` (dict) and `tensors` (infos; data read on demand)."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(self._map)
        if bytes(self._map[:4]) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version}")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        self.metadata: dict = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        self.metadata_end = cur.pos  # header + key/values; tensor infos follow
        raw = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
            raw.append((name, tuple(reversed(dims)), GGMLQuantizationType(cur.scalar("<I")), cur.scalar("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        self.data_start = -(-cur.pos // align) * align
        self.tensors = [TensorInfo(n, s, q, self.data_start + off) for n, s, q, off in raw]

    def header(self) -> bytes:
        """The bytes before the tensor data: the metadata and the tensor table."""
        return self._map[:self.data_start]

    @staticmethod
    def raw_shape(info: TensorInfo) -> tuple[int, ...]:
        """The shape `raw` gives the tensor's bytes: [*shape[:-1], row_bytes]."""
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        return (*info.shape[:-1], info.shape[-1] // block * type_size)

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as stored: uint8 [*shape[:-1], row_bytes] (a view of the file)."""
        shape = self.raw_shape(info)
        count = int(np.prod(shape, dtype=np.int64))
        if info.offset + count > len(self._map):
            raise ValueError(f"{self.path}: tensor {info.name} runs past the end of the file (truncated?)")
        return np.frombuffer(self._map, dtype=np.uint8, count=count, offset=info.offset).reshape(shape)

    def read(self, info: TensorInfo) -> np.ndarray:
        """The tensor as float32 (or its stored float type), shaped in torch order."""
        data = self.raw(info)
        if info.qtype == GGMLQuantizationType.F32:
            return data.view(np.float32).reshape(info.shape)
        if info.qtype == GGMLQuantizationType.F16:
            return data.view(np.float16).reshape(info.shape)
        return dequantize(data, info.qtype)
