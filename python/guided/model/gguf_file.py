"""Reading a GGUF file's metadata and tensors with the `gguf` package."""
from __future__ import annotations

from typing import Iterator

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize


class _MetadataOnlyReader(GGUFReader):
    """Skips mapping tensor data, so a truncated file (metadata-only part) still reads."""

    def _build_tensors(self, start_offs, fields):  # noqa: D401 - overrides a gguf internal
        self.tensors = []


def read_metadata(path: str) -> dict:
    """Every key/value as plain Python values (strings decoded, arrays as lists)."""
    return _fields_to_dict(_MetadataOnlyReader(path))


def open_gguf(path: str) -> tuple[dict, GGUFReader]:
    reader = GGUFReader(path)
    return _fields_to_dict(reader), reader


def _fields_to_dict(reader: GGUFReader) -> dict:
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        out[name] = _field_value(field)
    return out


def _field_value(field):
    kind = field.types[0] if field.types else None
    if kind == GGUFValueType.ARRAY and len(field.types) > 1 and field.types[1] != GGUFValueType.STRING:
        # numeric arrays (token types, scores): one numpy view instead of a Python loop
        return np.concatenate([field.parts[i] for i in field.data]).tolist() if field.data else []
    if kind == GGUFValueType.ARRAY:
        return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]][0]
    return value.item() if hasattr(value, "item") else value


def iter_tensors(reader: GGUFReader) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float array in torch's [out, in] order) for each tensor, dequantised."""
    for t in reader.tensors:
        yield t.name, dequantize(t.data, t.tensor_type)
