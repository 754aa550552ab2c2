"""Tool calling on real models, guided's server against llama.cpp's llama-server,
scored by BFCL's own questions and AST checker:

    python benches/bench_tools.py [--model qwen2.5-coder-0.5b qwen2.5-coder-1.5b] [--per-category 10]
                                  [--tool-choice auto required] [--concurrency 4] [--threads N]
                                  [--seed 0] [--llama-server PATH] [--no-peer | --peer-only] [--json PATH]
    python benches/bench_tools.py --auto-cost 3     # what tool_choice "auto"'s grammar costs, offline

Needs `make bench-setup`: bfcl-eval (BFCL v4's questions, possible answers and
checker, installed without its dependencies: see the Makefile) and llama.cpp's
llama-server built from the sources llama-cpp-python vendors. Without the
server the llama.cpp rows are skipped, with a line saying so.

Questions: --per-category of each of CATEGORIES (BFCL v4's names), a seeded
sample in file order, each with BFCL's language hint in its function docs as
BFCL's own runs send them. Tools are the docs converted as BFCL's OpenAI-style
FC handlers convert them (model_handler/utils.py convert_to_tool: "dict" →
object, "float" → number, "tuple" → array, "." in names → "_"); messages are
the question's own, as BFCL's FC handler sends them.

Engines: both serve the same GGUF over HTTP, asked through the `openai`
client at --concurrency requests in flight, greedy (temperature 0),
max_tokens 256, the model's own chat template. guided: `python -m
guided.serve` (its tool grammar holds for "auto" too, its default).
llama.cpp: `llama-server --jinja -c 8192 -np N --kv-unified` (one KV pool
for the N slots, as guided has, so no request is held to 8192/N tokens),
same thread count (guided: RAYON_NUM_THREADS and OMP_NUM_THREADS).
tool_choice: each of --tool-choice ("auto" is what BFCL sends its FC
models); irrelevance runs once per engine with "auto", since a call is what it
fails ("required" would fail every question by construction).

Printed per model, category, engine and tool_choice (markdown):
  AST            BFCL's verdict: the calls decoded as its OpenAI FC handler
                 decodes them, then ast_checker (irrelevance: right when no call
                 is made);
  own calls AST  the same with the calls past the expected count cut off: what
                 the model's first calls were worth, an upper bound where extra
                 calls are the engine's (not given for irrelevance);
  valid calls    returned calls whose name is a tool sent and whose arguments
                 validate against its parameters (jsonschema), / calls returned;
  no call        questions that expect a call answered without one (request
                 errors included), / those questions;
  calls/q        calls per question (mean);
  at max_tokens  answers cut by max_tokens (finish_reason "length");
  errors         requests that failed;
  wall s         the category's questions, sent concurrently, first to last;
and a row over the call categories. Then guided's AST minus llama.cpp's
(points) and llama.cpp's wall time / guided's, per category. --json writes the
rows, every question's calls and verdicts, the machine and llama-server's
version.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import types
import urllib.request
from pathlib import Path

import jsonschema
import openai

from machine import ROOT, cpu_flags, write_json

CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple",
              "live_multiple", "irrelevance")
MODELS = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
MAX_TOKENS = 256
CONTEXT = 8192
LLAMA_SERVER = ROOT / ".bench" / "llama.cpp" / "build" / "bin" / "llama-server"
#: The name the checker is told: tools are sent with "." in names turned to "_"
#: (OpenAI's name pattern), which its model table records as underscore_to_dot.
CHECKER_MODEL = "bench-tools-FC"


def _model_table() -> types.ModuleType:
    """A stand-in for bfcl's model table (constants/model_config.py), which imports
    every provider's SDK and which ast_checker imports only to ask whether the
    model's tool names had "." turned into "_": here, one entry that says so."""
    table = types.ModuleType("bfcl_eval.constants.model_config")
    table.MODEL_CONFIG_MAPPING = {CHECKER_MODEL: types.SimpleNamespace(underscore_to_dot=True)}
    return table


# bfcl writes its result, score and lock folders under BFCL_PROJECT_ROOT (by default
# beside the installed package).
os.environ.setdefault("BFCL_PROJECT_ROOT", str(ROOT / ".bench" / "bfcl"))
sys.modules.setdefault("bfcl_eval.constants.model_config", _model_table())
try:
    from bfcl_eval.constants.enums import Language, ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    from bfcl_eval.model_handler.utils import convert_to_tool
    from bfcl_eval.utils import (is_empty_output, is_function_calling_format_output,
                                 load_dataset_entry, load_ground_truth_entry)
except ImportError as err:
    sys.exit(f"bfcl-eval is not installed ({err}): run make bench-setup")


# ---- questions ------------------------------------------------------------------------------

def load_questions(categories: list[str], per_category: int, seed: int) -> list[dict]:
    """``per_category`` questions of each category (a seeded sample, in file order):
    its messages, BFCL's function docs, the tools sent, the possible answers
    (None for irrelevance)."""
    questions = []
    for category in categories:
        entries = load_dataset_entry(category)   # with BFCL's language hint, as its runs send
        answers = ({a["id"]: a["ground_truth"] for a in load_ground_truth_entry(category)}
                   if "irrelevance" not in category else {})
        picked = random.Random(f"{seed}:{category}").sample(range(len(entries)),
                                                            min(per_category, len(entries)))
        for i in sorted(picked):
            entry = entries[i]
            questions.append({"id": entry["id"], "category": category,
                              "messages": entry["question"][0], "functions": entry["function"],
                              "tools": to_tools(entry["function"]),
                              "answer": answers[entry["id"]] if answers else None})
    return questions


def to_tools(functions: list[dict]) -> list[dict]:
    """BFCL's function docs as its OpenAI-style FC handlers send them."""
    return convert_to_tool(functions, GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)


# ---- engines --------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def guided_command(path: str, port: int, args) -> list[str]:
    return [sys.executable, "-m", "guided.serve", "--model", path, "--port", str(port),
            "--log-level", "warning", "--max-model-len", str(CONTEXT)]


def llama_command(path: str, port: int, args) -> list[str]:
    return [args.llama_server, "-m", path, "--port", str(port), "--jinja", "-c", str(CONTEXT),
            "-np", str(args.concurrency), "--kv-unified", "-t", str(args.threads),
            "-tb", str(args.threads)]


@contextlib.contextmanager
def serving(command: list[str], threads: int, timeout: float = 600):
    """The base URL of the server ``command`` runs, once its /health answers 200;
    stopped on exit. Its output goes to a temporary file, printed if it fails."""
    port = int(command[command.index("--port") + 1])
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + timeout
            while not _healthy(base):
                if proc.poll() is not None or time.time() > deadline:
                    log.seek(0)
                    sys.exit(f"{command[0]} did not come up ({proc.poll()=}):\n{log.read()[-4000:]}")
                time.sleep(0.5)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


async def ask(client: openai.AsyncOpenAI, model: str, question: dict, tool_choice: str) -> dict:
    """One question: the calls returned ([name, arguments]), the text, the finish
    reason, or the error."""
    began = time.perf_counter()
    record = {"id": question["id"], "category": question["category"], "tool_choice": tool_choice,
              "calls": [], "content": None, "finish": None, "error": None}
    try:
        out = await client.chat.completions.create(
            model=model, messages=question["messages"], tools=question["tools"],
            tool_choice=tool_choice, temperature=0, max_tokens=MAX_TOKENS)
        message = out.choices[0].message
        record.update(calls=[[c.function.name, c.function.arguments] for c in message.tool_calls or []],
                      content=message.content, finish=out.choices[0].finish_reason,
                      completion_tokens=out.usage.completion_tokens if out.usage else None)
    except openai.APIError as err:
        record["error"] = f"{type(err).__name__}: {err}"[:500]
    record["seconds"] = time.perf_counter() - began
    return record


async def ask_all(base: str, questions: list[dict], tool_choice: str,
                  concurrency: int) -> tuple[list[dict], float]:
    """Every question, ``concurrency`` in flight; the records and the wall time."""
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=1800)
    model = (await client.models.list()).data[0].id
    gate = asyncio.Semaphore(concurrency)

    async def one(question: dict) -> dict:
        async with gate:
            return await ask(client, model, question, tool_choice)

    began = time.perf_counter()
    records = await asyncio.gather(*(one(q) for q in questions))
    wall = time.perf_counter() - began
    await client.close()
    return list(records), wall


def warm_up(base: str) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
    client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4, temperature=0,
                                   messages=[{"role": "user", "content": "Hello"}])
    client.close()


def run_engine(command: list[str], questions: list[dict], choices: list[str], args) -> list[dict]:
    """Start the server, warm it up, ask every category under each tool_choice
    (irrelevance once, with "auto"), stop it. One run per (tool_choice,
    category): its records and wall time."""
    runs = []
    with serving(command, args.threads) as base:
        warm_up(base)
        for choice in choices:
            for category in dict.fromkeys(q["category"] for q in questions):
                irrelevance = "irrelevance" in category
                if irrelevance and choice != choices[0]:
                    continue
                used = "auto" if irrelevance else choice
                batch = [q for q in questions if q["category"] == category]
                records, wall = asyncio.run(ask_all(base, batch, used, args.concurrency))
                runs.append({"tool_choice": used, "category": category, "records": records, "wall_s": wall})
                print(f"  {Path(command[0]).name if 'llama' in command[0] else 'guided'}: {category} "
                      f"({used}), {len(batch)} questions in {wall:.1f} s", file=sys.stderr, flush=True)
    return runs


def llama_version(binary: str) -> str | None:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = next((line for line in (out.stdout + out.stderr).splitlines() if "version" in line), "?")
    # make bench-setup's stamp beside build/bin/: the llama-cpp-python sdist it was built from
    sources = sorted(p.stem for p in Path(binary).resolve().parents[2].glob("*.built"))
    return f"{line}; from the sources of {', '.join(sources) or '?'}"


# ---- scoring --------------------------------------------------------------------------------

def bfcl_verdict(question: dict, calls: list) -> dict:
    """BFCL's verdict on ``calls`` ([name, arguments JSON]), as its eval runner
    gives it (_evaluate_single_ast_entry, _evaluate_single_relevance_entry) after
    its OpenAI FC handler's decode_ast: {"valid", "error"}."""
    try:
        decoded = [{name: json.loads(arguments)} for name, arguments in calls]
    except Exception as err:   # not a call: irrelevance passes, every other category fails
        return {"valid": question["answer"] is None, "error": f"decode: {err}"}
    if question["answer"] is None:
        return {"valid": is_empty_output(decoded), "error": None if is_empty_output(decoded) else "called"}
    if not is_function_calling_format_output(decoded):
        return {"valid": False, "error": "not in the function-calling format"}
    try:
        result = ast_checker(question["functions"], decoded, question["answer"], Language.PYTHON,
                             question["category"], CHECKER_MODEL)
    except Exception as err:   # the checker's own failure on an odd value: not valid
        return {"valid": False, "error": f"checker raised {type(err).__name__}: {err}"}
    return {"valid": result["valid"], "error": None if result["valid"] else result.get("error")}


def valid_call(question: dict, name: str, arguments: str | None) -> bool:
    """A call of a tool sent, with arguments that validate against its parameters."""
    tool = next((t["function"] for t in question["tools"] if t["function"]["name"] == name), None)
    try:
        args = json.loads(arguments or "")
    except ValueError:
        return False
    return tool is not None and isinstance(args, dict) and \
        jsonschema.Draft202012Validator(tool["parameters"]).is_valid(args)


def score(question: dict, record: dict) -> None:
    """Adds BFCL's verdict, the own-calls verdict and the valid-call count to ``record``."""
    calls = record["calls"]
    verdict = bfcl_verdict(question, calls)
    record.update(ast=verdict["valid"], ast_error=verdict["error"],
                  valid_calls=sum(valid_call(question, name, args) for name, args in calls))
    if question["answer"] is not None:
        record["own_ast"] = bfcl_verdict(question, calls[:len(question["answer"])])["valid"]


def summarize(model: str, engine: str, runs: list[dict]) -> list[dict]:
    """A row per run, then one per tool_choice over the call categories."""
    rows = []
    for run in runs:
        rows.append(_row(model, engine, run["tool_choice"], run["category"], run["records"], run["wall_s"]))
    for choice in dict.fromkeys(r["tool_choice"] for r in runs):
        calling = [r for r in runs if r["tool_choice"] == choice and "irrelevance" not in r["category"]]
        if calling:
            records = [rec for r in calling for rec in r["records"]]
            rows.append(_row(model, engine, choice, "call categories", records,
                             sum(r["wall_s"] for r in calling)))
    return rows


def _row(model: str, engine: str, choice: str, category: str, records: list[dict], wall: float) -> dict:
    expecting = [r for r in records if "own_ast" in r]
    calls = sum(len(r["calls"]) for r in records)
    return {"model": model, "engine": engine, "tool_choice": choice, "category": category,
            "questions": len(records), "ast": sum(r["ast"] for r in records),
            "own_ast": sum(r["own_ast"] for r in expecting) if expecting else None,
            "calls": calls, "valid_calls": sum(r["valid_calls"] for r in records),
            "expecting": len(expecting), "no_call": sum(not r["calls"] for r in expecting),
            "length": sum(r["finish"] == "length" for r in records),
            "errors": sum(r["error"] is not None for r in records), "wall_s": wall}


# ---- printing -------------------------------------------------------------------------------

def pct(part: int | None, whole: int) -> str:
    return "-" if part is None or not whole else f"{100 * part / whole:.0f}%"


def print_table(model: str, rows: list[dict], per_category: int) -> None:
    print(f"\n### {model}: BFCL v4, {per_category} questions per category, greedy, max_tokens {MAX_TOKENS}\n")
    print("| category | engine | tool_choice | AST | own calls AST | valid calls | no call | calls/q "
          "| at max_tokens | errors | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(rows, key=lambda r: (r["tool_choice"], _order(r["category"]), r["engine"])):
        print(f"| {r['category']} | {r['engine']} | {r['tool_choice']} | {pct(r['ast'], r['questions'])} "
              f"| {pct(r['own_ast'], r['expecting'])} | {pct(r['valid_calls'], r['calls'])} "
              f"| {pct(r['no_call'], r['expecting'])} | {r['calls'] / max(1, r['questions']):.2f} "
              f"| {pct(r['length'], r['questions'])} | {r['errors']} | {r['wall_s']:.1f} |")


def print_comparison(model: str, rows: list[dict]) -> None:
    """guided's AST minus llama.cpp's, in points, and the wall-time ratio, per row both have."""
    peer = {(r["tool_choice"], r["category"]): r for r in rows if r["engine"] == "llama.cpp"}
    pairs = [(r, peer[key]) for r in rows if r["engine"] == "guided"
             and (key := (r["tool_choice"], r["category"])) in peer]
    if not pairs:
        return
    print(f"\n{model}, guided vs llama.cpp:\n")
    print("| category | tool_choice | AST guided − llama.cpp (points) | wall llama.cpp / guided |")
    print("| --- | --- | --- | --- |")
    for ours, theirs in sorted(pairs, key=lambda p: (p[0]["tool_choice"], _order(p[0]["category"]))):
        gap = 100 * (ours["ast"] / ours["questions"] - theirs["ast"] / theirs["questions"])
        print(f"| {ours['category']} | {ours['tool_choice']} | {gap:+.0f} "
              f"| {theirs['wall_s'] / ours['wall_s']:.2f}x |")


def _order(category: str) -> int:
    return CATEGORIES.index(category) if category in CATEGORIES else len(CATEGORIES)


# ---- the cost of auto's grammar ------------------------------------------------------------

def auto_grammar_cost(path: str, questions: list[dict], rounds: int) -> dict:
    """tool_choice "auto" with its tool grammar (the default) and without
    (--no-tool-grammar), offline on one engine, the same questions in one
    batch, runs interleaved: generated tokens per second of each (best of
    ``rounds``), their ratio, and how many answers were the same text."""
    from guided import LLM, ChatOptions, SamplingParams
    llm = LLM(path, max_num_seqs=len(questions), max_model_len=CONTEXT)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    best, texts = {}, {}
    for _ in range(rounds):
        for enforced in (True, False):
            plans = [llm.prepare_chat(q["messages"], params, ChatOptions(tools=q["tools"], tool_choice="auto",
                                                                          tool_grammar=enforced))
                     for q in questions]
            began = time.perf_counter()
            outs = llm.run_chat(plans)
            seconds = time.perf_counter() - began
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            best[enforced] = max(best.get(enforced, 0.0), tokens / seconds)
            texts[enforced] = [o.outputs[0].text for o in outs]
    llm.close()
    same = sum(a == b for a, b in zip(texts[True], texts[False]))
    return {"grammar_tok_s": best[True], "free_tok_s": best[False], "ratio": best[True] / best[False],
            "same_answers": same, "questions": len(questions)}


# ---- main -----------------------------------------------------------------------------------

def model_path(name: str) -> str:
    """A GGUF path as given, else the catalogue model's (fetched once, verified)."""
    if os.path.exists(name):
        return name
    from guided.models import fetch
    return fetch(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=list(MODELS),
                    help="catalogue names (python/guided/models.py) or GGUF paths")
    ap.add_argument("--per-category", type=int, default=10)
    ap.add_argument("--categories", nargs="+", default=list(CATEGORIES), choices=CATEGORIES)
    ap.add_argument("--tool-choice", nargs="+", default=["auto", "required"], choices=["auto", "required"])
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight, both engines")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="compute threads, both engines")
    ap.add_argument("--seed", type=int, default=0, help="the sample of each category")
    ap.add_argument("--llama-server", default=str(LLAMA_SERVER))
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--no-peer", action="store_true", help="guided only")
    only.add_argument("--peer-only", action="store_true",
                      help="llama.cpp only (its rows beside guided's from an earlier run: no ratio)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows, every answer and the machine here")
    ap.add_argument("--auto-cost", type=int, metavar="ROUNDS", default=0,
                    help="instead: the cost of auto's tool grammar, offline (grammar on and off, "
                         "interleaved, best of ROUNDS)")
    args = ap.parse_args()
    print("CPU:", cpu_flags(), f"| threads {args.threads}, concurrency {args.concurrency}")
    peer = not args.no_peer and Path(args.llama_server).exists()
    version = llama_version(args.llama_server) if peer else None
    if not args.no_peer:
        print(f"llama-server: {version}" if peer else
              f"no llama-server at {args.llama_server} (make bench-setup): no llama.cpp rows")

    questions = load_questions(args.categories, args.per_category, args.seed)
    if args.auto_cost:
        for name in args.model:
            cost = auto_grammar_cost(model_path(name), questions, args.auto_cost)
            print(f"{name}: auto, {cost['questions']} questions in one batch: with the tool grammar "
                  f"{cost['grammar_tok_s']:.1f} tok/s, without {cost['free_tok_s']:.1f} tok/s, "
                  f"ratio {cost['ratio']:.3f}; {cost['same_answers']} answers the same text")
        return
    by_id = {q["id"]: q for q in questions}
    if args.peer_only and not peer:
        sys.exit(f"--peer-only: no llama-server at {args.llama_server} (make bench-setup)")
    engines = {**({} if args.peer_only else {"guided": guided_command}),
               **({"llama.cpp": llama_command} if peer else {})}
    rows, answers = [], []
    for name in args.model:
        path = model_path(name)
        model_rows = []
        for engine, command in engines.items():
            runs = run_engine(command(path, free_port(), args), questions, args.tool_choice, args)
            for run in runs:
                for record in run["records"]:
                    score(by_id[record["id"]], record)
                    answers.append({"model": name, "engine": engine, **record})
            model_rows += summarize(name, engine, runs)
        print_table(name, model_rows, args.per_category)
        print_comparison(name, model_rows)
        rows += model_rows
        write_json(args.json, "bench_tools", args, rows, answers=answers, llama_server=version,
                   questions={q["id"]: q["category"] for q in questions})


if __name__ == "__main__":
    main()
