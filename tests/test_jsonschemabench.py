"""A fixed sample of JSONSchemaBench through the bench's own code path (benches/jsonschemabench.py).

Asserts what must never regress: no invalid instance accepted, no crash or hang,
and at least as many schemas passing as raw llguidance on the same sample.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "jsonschemabench" / "data"
BENCHES = Path(__file__).resolve().parents[1] / "benches"
SAMPLE = 60


def _sample() -> list[str]:
    files = sorted(DATA.glob("*.json"))
    # deterministic and spread over every source: order by a hash of the name
    files.sort(key=lambda p: hashlib.sha256(p.name.encode()).hexdigest())
    return [str(p) for p in files[:SAMPLE]]


@pytest.fixture(scope="module")
def bench():
    if not DATA.is_dir():
        pytest.skip(f"JSONSchemaBench sample not found at {DATA}")
    pytest.importorskip("llguidance")
    if str(BENCHES) not in sys.path:
        sys.path.insert(0, str(BENCHES))
    import jsonschemabench
    try:
        jsonschemabench.tokenizer_path("smollm2")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"the default model's tokenizer is not installed: {e}")
    return jsonschemabench


@pytest.fixture(scope="module")
def result(bench):
    return bench.run_bench(_sample(), "smollm2", bench.ENGINES, timeout=30.0, jobs=2)


def test_no_invalid_instance_accepted(result):
    bad = [r for r in result["results"]["guided"] if r.invalidation]
    assert not bad, [(Path(r.file).name, r.message) for r in bad]


def test_no_crash_or_hang(result):
    s = result["summary"]["guided"]
    assert s["schemas"] == SAMPLE
    bad = [r for r in result["results"]["guided"] if r.status in ("crash", "timeout")]
    assert not bad, [(Path(r.file).name, r.status, r.message) for r in bad]


def test_passes_at_least_as_many_as_raw_llguidance(result):
    ours, raw = result["summary"]["guided"], result["summary"]["llguidance"]
    assert raw["schemas"] == SAMPLE
    assert ours["passing"] >= raw["passing"], (ours, raw)


def test_every_schema_raw_llguidance_passes_still_passes(result):
    raw_pass = {r.file for r in result["results"]["llguidance"] if r.status == "pass"}
    lost = [(Path(r.file).name, r.status, r.message) for r in result["results"]["guided"]
            if r.file in raw_pass and r.status != "pass"]
    assert not lost, lost
