"""The package as users install it: the wheel `make wheel` builds, installed
into a fresh venv outside the source tree, imported and run from there
(offline generation, chat with a json_schema answer and with a tool, and
`python -m guided.serve` answering the openai client).

guided's dependencies (torch alone is 2 GB) are not installed again: the
fresh venv reads this venv's site-packages through a .pth line. Python does
not process the .pth files of a directory added that way, so the source
checkout's editable install (guided.pth → python/) stays out of reach and
`import guided` finds only the wheel's copy (checked).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import jsonschema
import pytest

from helpers.live_server import running_server

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

#: Run by the fresh venv's python, outside the source tree.
SCRIPT = f"""
import json, sys
import guided
from guided import LLM, SamplingParams

llm = LLM(dtype="float32", max_num_seqs=4, kv_cache_tokens=4096)
out = llm.generate("The capital of France is", SamplingParams(max_tokens=12), use_tqdm=False)[0]
ask = [{{"role": "user", "content": "Give the largest city of Peru and its population."}}]
rf = {{"type": "json_schema", "json_schema": {{"name": "city", "schema": {SCHEMA!r}}}}}
answer = llm.chat(ask, SamplingParams(max_tokens=64), response_format=rf, use_tqdm=False)[0].outputs[0]
call = llm.chat([{{"role": "user", "content": "Weather in Lima?"}}], SamplingParams(max_tokens=64),
                tools=[{TOOL!r}], tool_choice="required", parallel_tool_calls=False,
                use_tqdm=False)[0].outputs[0]
print(json.dumps({{"file": guided.__file__, "prefix": sys.prefix, "version": guided.__version__,
                   "text": out.outputs[0].text, "answer": answer.content, "calls": call.tool_calls}}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`make wheel`'s build (maturin build --release), into a temporary folder."""
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "VIRTUAL_ENV": sys.prefix, "PATH": f"{BIN}:{os.environ['PATH']}"}
    done = subprocess.run([str(BIN / "maturin"), "build", "--release", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    [built] = out.glob("guided-*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_python(wheel, tmp_path_factory) -> Path:
    """A new venv holding the wheel (its dependencies read from this venv)."""
    home = tmp_path_factory.mktemp("wheel-venv") / "venv"
    venv.create(home, with_pip=False)
    python = home / "bin" / "python"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                           "--no-deps", "--no-index", "--quiet", str(wheel)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    site = subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()
    Path(site, "_guided_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_wheel_installs_and_runs_outside_the_source_tree(fresh_python, wheel, llm, tmp_path):
    assert wheel.name.startswith(f"guided-{_version()}-")
    # every requirement the wheel declares is met (the model package's own,
    # skipped by its --no-deps install, are not guided's)
    check = subprocess.run([sys.executable, "-m", "pip", "--python", str(fresh_python), "check"],
                           capture_output=True, text=True)
    assert not [line for line in check.stdout.splitlines() if line.startswith("guided ")], check.stdout
    done = subprocess.run([str(fresh_python), "-c", SCRIPT], cwd=tmp_path, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(got["prefix"]) and str(ROOT) not in got["file"], got["file"]
    assert got["version"] == _version()
    # the same tokens as the source tree's fp32 engine
    from guided import SamplingParams
    assert got["text"] == llm.generate("The capital of France is", SamplingParams(max_tokens=12),
                                       use_tqdm=False)[0].outputs[0].text
    jsonschema.validate(json.loads(got["answer"]), SCHEMA)
    [call] = got["calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL["function"]["parameters"])


def test_wheel_serves_the_openai_client(fresh_python, tmp_path):
    from openai import OpenAI
    command = [str(fresh_python), "-m", "guided.serve", "--log-level", "warning"]
    with running_server("--kv-cache-tokens", "2048", "--max-num-seqs", "2", command=command,
                        cwd=str(tmp_path)) as base:
        client = OpenAI(base_url=base + "/v1", api_key="none")
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=16,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert reply.choices[0].message.content and reply.choices[0].finish_reason in ("stop", "length")


def _version() -> str:
    import guided   # the source tree's
    return guided.__version__
