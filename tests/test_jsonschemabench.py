"""A fixed sample of JSONSchemaBench through the bench itself (benches/jsonschemabench.py,
run as a program, as a user runs it).

Asserts what must never regress: no invalid instance accepted, no crash or hang,
and at least as many schemas passing as raw llguidance on the same sample.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SHARED

DATA = SHARED / "jsonschemabench" / "data"
BENCH = Path(__file__).resolve().parents[1] / "benches" / "jsonschemabench.py"
SAMPLE = 60


def _sample() -> list[str]:
    files = sorted(DATA.glob("*.json"))
    # deterministic and spread over every source: order by a hash of the name
    files.sort(key=lambda p: hashlib.sha256(p.name.encode()).hexdigest())
    return [str(p) for p in files[:SAMPLE]]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    if not DATA.is_dir():
        pytest.skip(f"JSONSchemaBench sample not found at {DATA}")
    pytest.importorskip("llguidance")
    from guided.model import ModelNotFoundError, default_model_path
    try:
        default_model_path()
    except ModelNotFoundError as e:
        pytest.skip(f"the default model's tokenizer is not installed: {e}")
    out = tmp_path_factory.mktemp("jsonschemabench") / "results.json"
    run = subprocess.run([sys.executable, str(BENCH), *_sample(), "--tokenizer", "smollm2",
                          "--timeout", "30", "--jobs", "2", "--results", str(out)],
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    print(run.stdout)
    return json.loads(out.read_text())


def _passing(rs: list[dict]) -> int:
    return sum(r["status"] == "pass" for r in rs)


def test_no_invalid_instance_accepted(results):
    bad = [r for r in results["guided"] if r["invalidation"]]
    assert not bad, [(Path(r["file"]).name, r["message"]) for r in bad]


def test_no_crash_or_hang(results):
    assert len(results["guided"]) == SAMPLE
    bad = [r for r in results["guided"] if r["status"] in ("crash", "timeout")]
    assert not bad, [(Path(r["file"]).name, r["status"], r["message"]) for r in bad]


def test_passes_at_least_as_many_as_raw_llguidance(results):
    assert len(results["llguidance"]) == SAMPLE
    assert _passing(results["guided"]) >= _passing(results["llguidance"])


def test_every_schema_raw_llguidance_passes_still_passes(results):
    raw_pass = {r["file"] for r in results["llguidance"] if r["status"] == "pass"}
    lost = [(Path(r["file"]).name, r["status"], r["message"]) for r in results["guided"]
            if r["file"] in raw_pass and r["status"] != "pass"]
    assert not lost, lost
