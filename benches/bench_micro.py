"""Micro-benchmarks of the native core and the chat parser, under pytest-benchmark:

    make bench-micro          # pytest benches/bench_micro.py --benchmark-autosave ...
    pytest benches/bench_micro.py --benchmark-compare   # against the last saved run

Each result is saved as JSON (.benchmarks/, and bench-report/micro.json from
make bench-micro), so a change can be compared with --benchmark-compare.

- mask per token: a Matcher walking a valid instance of one constraint of each
  kind (a JSON schema, a regex, a choice, a Lark grammar), compute_mask then
  consume_token per token; the figure is one whole walk, extra_info gives the
  per-token mean;
- the closing search: Matcher.shortest_completion from the middle of a JSON
  instance (what the engine runs as a request nears its budget);
- grammar compile: a JSON schema, compiled without the compiler's cache;
- one scheduler step (schedule + sample + update, in Rust, without the model
  forward) at batch 1 and 32, every row decoding;
- the chat parser over a tool call streamed one token per push, and over
  one call with a long string argument (256 B, 4 KB, 16 KB) in a JSON and
  an XML format: extra_info gives the mean per-token cost, which should
  not grow with the argument (each push reads on from the last).

Tokenizers come from GGUF metadata only; only the parser case loads the
default model (for its chat template).
"""
from __future__ import annotations

import json
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from jsonschemabench import encode, load_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "vip"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                 "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["vip", "a"],
            "address": {"city": "London", "zip": "12345"}}

#: kind → (structured_outputs, a valid output)
CONSTRAINTS = {
    "json": ({"json": SCHEMA}, json.dumps(INSTANCE)),
    "regex": ({"regex": r"[a-z]+(\.[a-z]+)*@[a-z]+\.(com|org|net)"}, "alan.turing@enigma.com"),
    "choice": ({"choice": ["positive", "negative", "neutral", "mixed feelings"]}, "mixed feelings"),
    "lark": ({"grammar": 'start: "SELECT " cols " FROM " NAME (" WHERE " NAME "=" NUMBER)?\n'
                         'cols: NAME (", " NAME)*\nNAME: /[a-z_]+/\nNUMBER: /[0-9]+/'},
             "SELECT id, name, email FROM users WHERE id=42"),
}


@lru_cache(maxsize=None)
def vocabulary():
    """(tokenizer, end ids, vocab size, guided's GrammarCompiler) of SmolLM2."""
    from guided._native import GrammarCompiler
    from guided.tokenizer import plain_encoder, token_bytes
    tok, end_ids, vocab = load_tokenizer("smollm2")
    return tok, sorted(end_ids), vocab, GrammarCompiler(token_bytes(tok), sorted(end_ids), vocab,
                                                         tokenize=plain_encoder(tok))


def compiled(kind: str):
    from guided.grammar import compose
    tok, _, _, compiler = vocabulary()
    so, text = CONSTRAINTS[kind]
    return compiler.compile(compose(so).text), encode(tok, text)


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_mask_per_token(benchmark, kind):
    grammar, tokens = compiled(kind)

    def walk():
        m = grammar.matcher()
        for t in tokens:
            m.compute_mask()
            if not m.consume_token(t):
                raise AssertionError(f"{kind}: token {t} refused: {m.error()}")

    benchmark(walk)
    benchmark.extra_info.update(tokens=len(tokens),
                                us_per_token=benchmark.stats.stats.mean * 1e6 / len(tokens))


def test_closing_search(benchmark):
    grammar, tokens = compiled("json")
    half = tokens[:len(tokens) // 2]

    def close():
        m = grammar.matcher()
        m.consume_tokens(half)
        return m.shortest_completion(512)

    tail = benchmark(close)
    assert tail, "no completion found"
    benchmark.extra_info.update(from_token=len(half), completion_tokens=len(tail))


def test_grammar_compile(benchmark):
    from guided._native import GrammarCompiler
    from guided.grammar import compose
    from guided.tokenizer import plain_encoder, token_bytes
    tok, end_ids, vocab, _ = vocabulary()
    compiler = GrammarCompiler(token_bytes(tok), end_ids, vocab, cache_size=1, tokenize=plain_encoder(tok))
    texts = [compose({"json": {**SCHEMA, "properties": {**SCHEMA["properties"], "name": {
        "type": "string", "maxLength": 40 + i}}}}).text for i in range(2)]
    assert texts[0] != texts[1]
    state = {"i": 0}

    def compile_fresh():   # alternate two texts: a cache of one never hits
        state["i"] ^= 1
        return compiler.compile(texts[state["i"]])

    benchmark(compile_fresh)


@pytest.mark.parametrize("batch", [1, 32])
def test_scheduler_step(benchmark, batch):
    from guided import SamplingParams
    from guided._native import Scheduler
    _, end_ids, vocab, _ = vocabulary()
    steps = 4000   # more than pytest-benchmark's rounds: every row keeps decoding
    sched = Scheduler(num_blocks=batch * (steps // 16 + 4), block_size=16, max_num_seqs=batch,
                      max_num_batched_tokens=max(2048, batch), max_model_len=steps + 64,
                      eos_token_ids=end_ids, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=steps, temperature=0.7, seed=0, ignore_eos=True)
    for r in range(batch):
        sched.add_request(r, list(range(100, 132)), params)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((batch, vocab), dtype=np.float32)

    def step():
        plan = sched.schedule()
        rows = len(plan.sample_seq_ids)
        tokens, _, _ = sched.sample(logits[:rows])
        sched.update(tokens)
        return rows

    step()   # the prefill
    benchmark.pedantic(step, rounds=min(steps - 10, 2000), warmup_rounds=5)
    assert step() == batch


@pytest.fixture(scope="module")
def chat_llm():
    from guided import LLM
    return LLM(dtype="float32", max_num_seqs=4, kv_cache_tokens=4096)


def test_streamed_tool_call_parsing(benchmark, chat_llm):
    from guided import ChatOptions, SamplingParams
    person = {**SCHEMA, "properties": {k: v for k, v in SCHEMA["properties"].items() if k != "email"},
              "required": ["name", "age", "tags"]}
    tool = {"type": "function", "function": {"name": "record_person", "parameters": person}}
    ask = [{"role": "user", "content": "Record Ada Lovelace."}]
    plan = chat_llm.prepare_chat(ask, SamplingParams(max_tokens=256),
                                 ChatOptions(tools=[tool], tool_choice="required"))
    [out] = chat_llm.run_chat([plan])
    tokens = out.outputs[0].token_ids
    assert out.outputs[0].tool_calls, out.outputs[0].text

    def parse():
        parser = plan.parser()
        for t in tokens:
            parser.push([t])
        return parser.finish()

    benchmark(parse)
    benchmark.extra_info.update(tokens=len(tokens))


#: a call whose one argument is long, in a JSON and an XML argument format
LONG_ARGUMENT_SIZES = (256, 4096, 16384)


@lru_cache(maxsize=None)
def default_chat():
    """The default model's tokenizer and registry (GGUF metadata only)."""
    from guided.model.gguf_file import GGUFFile
    from guided.model.gguf_loader import gguf_tokenizer_info
    from guided.model.loader import default_model_path
    from guided.special_tokens import SpecialTokens
    from guided.tokenizer import TokenizerWrapper
    info = gguf_tokenizer_info(GGUFFile(default_model_path()).metadata)
    special = SpecialTokens.classify(info["tokenizer"], info["end_token_ids"], info["bos_token"])
    return special, TokenizerWrapper(info["tokenizer"], special, False)


@pytest.mark.parametrize("size", LONG_ARGUMENT_SIZES)
@pytest.mark.parametrize("fmt_name", ["hermes", "qwen3_coder"])
def test_streamed_long_argument(benchmark, fmt_name, size):
    from guided.chat.parser import ChatParser
    from guided.chat.tool_formats import TABLE, DetectedFormat
    special, tok = default_chat()
    fmt = DetectedFormat(next(f for f in TABLE if f.name == fmt_name), parallel=True, content_sep=None,
                         empty_content=None)
    words = "The quick brown fox jumps over the lazy dog, \"quoted\" {braces} and\nnew lines. "
    body = (words * (size // len(words) + 1))[:size]
    call = {"name": "write_file", "arguments": {"path": "notes.txt", "content": body}, "id": ""}
    tokens = tok.encode(fmt.format.render([call], special), parse_special=False)
    schemas = {"write_file": {"type": "object", "properties": {"path": {"type": "string"},
                                                               "content": {"type": "string"}}}}

    def parse():
        parser = ChatParser(special, tok, fmt, schemas, None, None)
        deltas = [d for t in tokens for d in parser.push([t])] + parser.finish()
        return "".join(c["function"].get("arguments", "") for d in deltas for c in d.tool_calls or [])

    streamed = benchmark(parse)
    assert json.loads(streamed) == call["arguments"]
    benchmark.extra_info.update(tokens=len(tokens),
                                us_per_token=benchmark.stats.stats.mean / len(tokens) * 1e6)
