"""A tool whose name is a prefix of another's (issue 50, item 5): the
parser reports the name the model wrote, never a shorter declared one, in
every format of the table, whole and streamed alike.

Generated tool sets: names that extend one another (``f``, ``f1``,
``f1_b``…), sharing argument names with a type of their own per tool; calls
written as the format renders a call (ToolFormat.render), tokenized as a
rendered prompt is, then read back by the chat parser in one push and token
by token, and by calls.parse_calls at every character the text reaches: a
call is never named before its name is known. No model is loaded: the
default model's tokenizer, with the table's markers added as its tokens.
"""
from __future__ import annotations

import functools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from guided.chat.calls import ReadState, parse_calls
from guided.chat.parser import ChatParser
from guided.chat.prompt import ControlEscaper, tokenize_rendered
from guided.chat.tool_formats import CALL_ID, MARKERS, TABLE, TEXT_ENVELOPE, DetectedFormat
from guided.outputs import CompletionOutput, RequestOutput

FORMATS = {f.name: f for f in (*TABLE, TEXT_ENVELOPE)}
BADGE = "badge_api_BadgeApi_get_project_vulnerabilities_badge"
#: characters of a string value every format writes back as itself (no
#: quote, no tag opening, no backslash: the raw-string formats' limits)
VALUE_CHARS = " ab1_-.,:{}[]()\né"
VALUES = {"string": st.text(VALUE_CHARS, max_size=8), "integer": st.integers(-99, 99),
          "boolean": st.booleans(), "array": st.lists(st.integers(0, 9), max_size=3)}


@functools.cache
def chat():
    """(special tokens, tokenizer): the default model's, every marker of the table added."""
    from guided.model import default_model_path
    from guided.model.gguf_file import GGUFFile
    from guided.model.gguf_loader import gguf_tokenizer_info
    from guided.special_tokens import SpecialTokens
    from guided.tokenizer import TokenizerWrapper
    info = gguf_tokenizer_info(GGUFFile(str(default_model_path())).metadata)
    tokenizer = info["tokenizer"]
    tokenizer.add_special_tokens([AddedToken(m.text, special=True, normalized=False) for m in MARKERS])
    special = SpecialTokens.classify(tokenizer, info["end_token_ids"], info["bos_token"])
    return special, TokenizerWrapper(tokenizer, special, False)


@st.composite
def tool_sets(draw) -> dict[str, dict]:
    """Two to five tools whose names are prefixes of one another, each with
    up to three of the same few argument names, typed per tool."""
    base = draw(st.text("ab_", min_size=1, max_size=5))
    tails = draw(st.lists(st.text("1b_.-", min_size=1, max_size=3), min_size=1, max_size=4, unique=True))
    names = [base] + [base + t for t in tails]
    schemas = {}
    for name in draw(st.permutations(names)):   # the declaration order is drawn too
        keys = draw(st.lists(st.sampled_from(["uuid", "name", "version"]), max_size=3, unique=True))
        props = {k: {"type": draw(st.sampled_from(sorted(VALUES)))} for k in keys}
        schemas[name] = {"type": "object", "properties": props, "required": keys}
    return schemas


@st.composite
def messages(draw) -> tuple[dict[str, dict], list[dict]]:
    """(tool schemas, one to three calls of those tools)."""
    schemas = draw(tool_sets())
    calls = []
    for i in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(sorted(schemas)))
        props = schemas[name]["properties"]
        calls.append({"name": name, "id": f"c{i}x7QmZ2a",
                      "arguments": {k: draw(VALUES[p["type"]]) for k, p in props.items()}})
    return schemas, calls


def detected(fmt) -> DetectedFormat:
    return DetectedFormat(fmt, parallel=True, content_sep=None, empty_content=None,
                          native=fmt is not TEXT_ENVELOPE)


def tokens(fmt, text: str) -> list[int]:
    """The ids a model writes for ``text``: markers as their tokens (the text
    envelope's are plain text: it is for tokenizers with none)."""
    special, tok = chat()
    if fmt is TEXT_ENVELOPE:
        return tok.encode_text(text)
    return tokenize_rendered(text, special, tok, ControlEscaper(special, []))


def parse(fmt, schemas: dict[str, dict], ids: list[int], stream: bool):
    """(the message, the streamed deltas) the chat parser gives for ``ids``,
    pushed at once or one token at a time."""
    special, tok = chat()
    parser = ChatParser(special, tok, detected(fmt), schemas, None, None)
    deltas = [d for t in ids for d in parser.push([t])] if stream else parser.push(ids)
    deltas += parser.finish()
    sample = CompletionOutput(index=0, text="", token_ids=ids, cumulative_logprob=None, logprobs=None,
                              finish_reason="stop")
    return parser.result(RequestOutput(request_id=0, prompt=None, prompt_token_ids=[], outputs=[sample])), deltas


def expected_id(fmt, call: dict, index: int) -> str | None:
    if CALL_ID in fmt.call:
        return call["id"]
    return fmt.id_template.format(name=call["name"], index=index) if fmt.id_template else None


def assert_reads_back(fmt, schemas: dict[str, dict], calls: list[dict]):
    text = fmt.render(calls, chat()[0])
    ids = tokens(fmt, text)
    whole, _ = parse(fmt, schemas, ids, stream=False)
    streamed, deltas = parse(fmt, schemas, ids, stream=True)
    where = (fmt.name, text)
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.tool_calls]
    assert got == [(c["name"], c["arguments"]) for c in calls], where
    for i, (call, c) in enumerate(zip(calls, whole.tool_calls)):
        if expected_id(fmt, call, i) is not None:
            assert c["id"] == expected_id(fmt, call, i), where
    assert whole.content is None and whole.finish_reason == "tool_calls", (where, whole)
    strip = lambda r: [c["function"] for c in r.tool_calls]   # noqa: E731 (ids: new per parse unless written)
    assert strip(streamed) == strip(whole) and streamed.content == whole.content, where
    # a name is streamed once, and only the one the model wrote
    named = [(c["index"], c["function"]["name"]) for d in deltas for c in d.tool_calls or []
             if "name" in c["function"]]
    assert named == [(i, c["name"]) for i, c in enumerate(calls)], where


def assert_never_misnamed(fmt, schemas: dict[str, dict], calls: list[dict]):
    """Read on at every character: each call named so far has its own name."""
    text, fmt_d, state = fmt.render(calls, chat()[0]), detected(fmt), ReadState()
    for end in range(len(text) + 1):
        read, ok = parse_calls(text[:end], fmt_d, schemas, chat()[0], state)
        names = [c.name for c in read if c.name is not None]
        assert names == [c["name"] for c in calls[:len(names)]], (fmt.name, text[:end])
    assert ok and all(c.done for c in read) and len(read) == len(calls), (fmt.name, text)


@pytest.mark.parametrize("name", sorted(FORMATS))
@settings(max_examples=15)
@given(message=messages())
def test_prefix_names_read_back(name, message):
    schemas, calls = message
    fmt = FORMATS[name]
    assert_reads_back(fmt, schemas, calls)
    assert_never_misnamed(fmt, schemas, calls)


def test_bfcl_badge_names_in_hermes():
    """The BFCL entry: ``…_badge`` (name, version) and ``…_badge1`` (uuid),
    a call of ``…_badge1`` in Hermes' format."""
    schemas = {BADGE: {"type": "object", "properties": {"name": {"type": "string"}, "version": {"type": "string"}},
                       "required": ["name", "version"]},
               BADGE + "1": {"type": "object", "properties": {"uuid": {"type": "string"}}, "required": ["uuid"]}}
    fmt = FORMATS["hermes"]
    text = ('<tool_call>\n{"name": "' + BADGE + '1", "arguments": '
            '{"uuid": "0b5c3e3e-5b4a-4b0e-8c5e-2b8f1a4c9d11"}}\n</tool_call>')
    assert text == fmt.render([{"name": BADGE + "1", "arguments": {"uuid": "0b5c3e3e-5b4a-4b0e-8c5e-2b8f1a4c9d11"},
                                "id": ""}], chat()[0])
    for stream in (False, True):
        reply, _ = parse(fmt, schemas, tokens(fmt, text), stream=stream)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls] == \
            [(BADGE + "1", {"uuid": "0b5c3e3e-5b4a-4b0e-8c5e-2b8f1a4c9d11"})], stream
