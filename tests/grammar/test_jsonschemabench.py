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
BENCH = Path(__file__).resolve().parents[2] / "benches" / "jsonschemabench.py"
SAMPLE = 60
# Real schemas only our grammar writer passes (llguidance's compiler alone refuses them or
# rejects their valid instances): keys in another order than the schema's (docker compose,
# a JSON:API document), past the compiler's size limit, a recursive oneOf, a recursive $ref
# beside other keywords, an exponent in a number with a minimum, 2.0 for an integer.
WRITER = ["Github_hard---o74015.json", "Github_hard---o366.json", "Github_hard---o13024.json",
          "Github_hard---o3905.json", "WashingtonPost---wp_1_Normalized.json",
          "Github_hard---o57716.json", "Github_medium---o61348.json"]


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
    files = _sample() + [str(DATA / name) for name in WRITER if str(DATA / name) not in _sample()]
    run = subprocess.run([sys.executable, str(BENCH), *files, "--tokenizer", "smollm2",
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


def _in_sample(rs: list[dict]) -> list[dict]:
    sample = set(_sample())
    return [r for r in rs if r["file"] in sample]


def test_no_crash_or_hang(results):
    assert len(_in_sample(results["guided"])) == SAMPLE
    bad = [r for r in results["guided"] if r["status"] in ("crash", "timeout")]
    assert not bad, [(Path(r["file"]).name, r["status"], r["message"]) for r in bad]


def test_passes_at_least_as_many_as_raw_llguidance(results):
    assert len(_in_sample(results["llguidance"])) == SAMPLE
    assert _passing(_in_sample(results["guided"])) >= _passing(_in_sample(results["llguidance"]))


def test_schemas_only_the_writer_passes(results):
    by_name = {Path(r["file"]).name: r for r in results["guided"]}
    failing = [(n, by_name[n]["status"], by_name[n]["message"]) for n in WRITER if by_name[n]["status"] != "pass"]
    assert not failing, failing


def test_every_schema_raw_llguidance_passes_still_passes(results):
    raw_pass = {r["file"] for r in results["llguidance"] if r["status"] == "pass"}
    lost = [(Path(r["file"]).name, r["status"], r["message"]) for r in results["guided"]
            if r["file"] in raw_pass and r["status"] != "pass"]
    assert not lost, lost
