"""The package as users install it: `pip wheel .` in a plain shell (no
venv activated, nothing on PATH but the system's), the wheel installed
into a fresh venv outside the source tree, imported and run from there
(offline generation, chat with a json_schema answer and with a tool, and
`python -m guided.serve` answering the openai client).

guided's dependencies (torch alone is 2 GB) are not installed again: the
fresh venv reads this venv's site-packages through a .pth line. Python does
not process the .pth files of a directory added that way, so the source
checkout's editable install (guided.pth → python/) stays out of reach and
`import guided` finds only the wheel's copy (checked). What `make test`
adds to `make serve`'s set-up (requirements-test.txt: the clients, pytest,
transformers, ...) is made unimportable there, so the wheel is seen to run
and serve on requirements.txt alone.
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


#: Run in the fresh venv at start-up (a .pth line imports it): the
#: distributions requirements-test.txt adds to requirements.txt cannot be imported.
BLOCKER = """
import sys
BLOCKED = {blocked!r}
class Hidden:
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return None   # as if not installed
        return self.finder.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.finder, attr)
sys.meta_path[:] = [Hidden(f) for f in sys.meta_path]
"""


def requirement_names(path: Path) -> set[str]:
    """Distribution names a requirements file pins (not those it includes with -r)."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {line.split("==")[0].lower().replace("_", "-") for line in lines if line and not line.startswith("-")}


def only_test_modules() -> set[str]:
    """Top-level modules of the distributions only requirements-test.txt installs."""
    from importlib.metadata import distribution
    only_test = requirement_names(ROOT / "requirements-test.txt") - requirement_names(ROOT / "requirements.txt")
    modules = set()
    for name in only_test:
        dist = distribution(name)
        top = dist.read_text("top_level.txt")
        found = top.split() if top else {f.parts[0].removesuffix(".py") for f in dist.files or ()
                                         if f.parts[0].endswith(".py") or (len(f.parts) > 1 and f.parts[1] == "__init__.py")}
        modules.update(m for m in found if m and not m.startswith("_") and m != "nvidia")
    return modules


def test_requirements_split_serving_from_testing():
    """requirements.txt pins what the wheel declares; the test stack is apart."""
    import tomllib
    declared = {d.split(">")[0].split("=")[0].split("<")[0].strip().lower()
                for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    serving = requirement_names(ROOT / "requirements.txt")
    assert declared <= serving, declared - serving
    assert not serving & {"pytest", "transformers", "openai", "anthropic", "hypothesis", "mypy"}
    assert {"openai", "pytest", "transformers", "vllm_router"} <= only_test_modules()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel .` as a user runs it in a plain shell: no venv activated,
    the system's PATH (this venv's pip, with its maturin, as the build
    backend), into a temporary folder."""
    out = tmp_path_factory.mktemp("dist")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != BIN)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation",
                           "--wheel-dir", str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
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
    Path(site, "_guided_no_test_stack.py").write_text(BLOCKER.format(blocked=sorted(only_test_modules())))
    Path(site, "_guided_no_test_stack.pth").write_text("import _guided_no_test_stack\n")
    blocked = subprocess.run([str(python), "-c", "import openai"], capture_output=True, text=True)
    assert "No module named 'openai'" in blocked.stderr, blocked.stderr
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
