"""What the structured-output tests share: a schema shorthand, the JSON
Schema validator outputs are checked with, and JSONSchemaBench's schemas
(``SHARED``/jsonschemabench, where a clone has it)."""
from __future__ import annotations

import hashlib
import json
from typing import Iterator

import pytest

from helpers import SHARED

jsonschema = pytest.importorskip("jsonschema")

BENCH_DATA = SHARED / "jsonschemabench" / "data"


def obj(props: dict, required=None, **kw) -> dict:
    """An object schema of ``props``, all of them required unless ``required`` says which."""
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required, **kw}


def validator(schema: dict):
    """The schema's validator (its own draft, 2020-12 by default), formats checked."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def parses(text: str) -> bool:
    """Whether ``text`` is one whole JSON value."""
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def bench_schemas(max_size: int) -> Iterator[tuple[str, dict]]:
    """JSONSchemaBench's schemas no larger than ``max_size`` (its meta
    full_size), as (name, schema), in a fixed order spread by name hash;
    none where the data is absent."""
    if not BENCH_DATA.is_dir():
        return
    files = sorted(BENCH_DATA.glob("*.json"), key=lambda p: hashlib.sha256(p.name.encode()).hexdigest())
    for f in files:
        doc = json.loads(f.read_text())
        if doc.get("meta", {}).get("full_size", 10**9) <= max_size and isinstance(doc.get("schema"), dict):
            yield f.stem, doc["schema"]
