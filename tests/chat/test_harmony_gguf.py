"""gpt-oss from one GGUF: weights, template and tool format together.

A tiny random GptOssForCausalLM over the default model's byte-level vocabulary,
saved with harmony's special tokens and template and converted by the tests'
GGUF writer (helpers/family_model.py), is loaded with ``LLM(path)`` alone: the
architecture, the chat template and the formats all come from the file, as
they do from a published gpt-oss GGUF. Then a four-turn agent loop, sent back
turn by turn as an OpenAI client would (content None, reasoning_content,
tool_calls; a "tool" message per call):

- a required call is a valid call after a reasoning block, and the texts hold
  no harmony marker;
- the loop keeps hitting the prefix cache: the client's reasoning_content
  goes to the template's ``thinking``, which re-renders a call turn's analysis
  as the model wrote it (the reasoning effort stays the same on every turn:
  harmony writes it into the system message, so changing it would re-render
  the prompt from its first tokens); a call the model wrote in another of
  gpt-oss's spellings (the analysis channel, the recipient after the
  channel, another content type) comes back in the template's own, so
  there the next prompt holds the turn up to the call;
- the answer parsed one token at a time is the answer parsed whole.

The other families run on the default model's weights with renamed tokens
(test_chat_tools.py, test_chat_cache.py); this is the one model whose weights
are of the architecture its template was written for.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from guided import ChatOptions, SamplingParams
from guided.chat.message_formats import marker_ids
from helpers.families import BY_NAME
from helpers.family_model import family_gguf
from helpers.agent_loop import SYSTEM, run_loop, turn_options
from helpers.tools import ASK, SCHEMAS
from test_chat_tools import reassemble

#: the least share of the previous prompt and answer a turn finds in the cache
#: (the cache holds whole blocks of 16 tokens)
SHARE = 0.9


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, default_gguf):
    """The tiny harmony gpt-oss, loaded from its GGUF with nothing else said."""
    from guided import LLM
    path = family_gguf("gpt-oss", default_gguf, tmp_path_factory.mktemp("harmony"))
    llm = LLM(path, kv_cache_tokens=4096, max_num_seqs=4)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def loop(gpt_oss) -> list[tuple[list[dict], SamplingParams, dict, object]]:
    """Each turn's (messages sent, sampling, options, RequestOutput); the same effort throughout."""
    return run_loop(gpt_oss, reasoning_effort="low")


def marker_texts(llm) -> list[str]:
    """harmony's markers and every other control token's text."""
    special = llm.engine.special
    return sorted(set(BY_NAME["gpt-oss"].markers) | {special.text(t) for t in special.control_ids})


def test_the_gguf_gives_architecture_template_and_formats(gpt_oss, default_gguf):
    """Weights, template and formats, all read from the one file."""
    from guided.model.gguf_file import GGUFFile
    from helpers.templates import WRITTEN
    assert gpt_oss.engine.loaded.config.architecture == "gpt_oss"
    # the default model's byte-level vocabulary, every id an embedding row
    assert gpt_oss.engine.loaded.config.vocab_size == len(GGUFFile(default_gguf).metadata["tokenizer.ggml.tokens"])
    assert gpt_oss.chat_format.template == WRITTEN["written: harmony (gpt-oss)"]
    assert gpt_oss.chat_format.tools.format.name == "harmony"
    assert gpt_oss.chat_format.markers.name == "harmony"
    end = gpt_oss.chat_format.special.id_of_text(BY_NAME["gpt-oss"].eos)
    assert end in gpt_oss.engine.special.end_ids


def test_required_turns_reason_then_call_a_valid_tool(gpt_oss, loop):
    """An analysis block, then calls that fit their tool's schema, no content."""
    markers = marker_texts(gpt_oss)
    for messages, _, _, out in loop[:-1]:
        reply = out.outputs[0]
        where = (len(messages), reply.text)
        assert reply.finish_reason == "tool_calls", where
        assert reply.content is None, where
        assert reply.reasoning_content and reply.reasoning_content.strip(), where
        assert not [m for m in markers if m in reply.reasoning_content], where
        assert len(reply.tool_calls) >= 1, where
        for call in reply.tool_calls:
            assert call["type"] == "function" and call["id"], call
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_the_last_turn_answers_in_text(gpt_oss, loop):
    """tool_choice="none": a final answer in text, no call, no marker."""
    reply = loop[-1][3].outputs[0]
    assert reply.finish_reason in ("stop", "length"), reply.text
    assert reply.tool_calls == [], reply.text
    assert reply.content and reply.content.strip(), reply.text
    assert not [m for m in marker_texts(gpt_oss) if m in reply.content + (reply.reasoning_content or "")]


def kept(llm, out) -> int:
    """How many of an answer's tokens the next prompt holds as they were:
    all of them where its call is in the template's own spelling (or it has
    none); where the model wrote the call otherwise, those up to the call
    (the end of its analysis), as the template renders the call its own way."""
    chat, reply = llm.chat_format, out.outputs[0]
    ids = list(reply.token_ids)
    if not reply.tool_calls:
        return len(ids)
    own = chat.tools.format.render([{"name": c["function"]["name"], "id": c["id"],
                                     "arguments": json.loads(c["function"]["arguments"])} for c in reply.tool_calls],
                                   chat.special)
    if chat.tokenizer.decode(ids, skip_special_tokens=False).endswith(own):
        return len(ids)
    end = marker_ids(chat.markers.end, chat.special, chat.tokenizer)
    at = next((i for i in range(len(ids) - len(end) + 1) if ids[i:i + len(end)] == end), None)
    assert at is not None, reply.text   # the required call follows an analysis here (effort "low")
    return at + len(end)


def test_each_turn_finds_the_previous_one_in_the_prefix_cache(gpt_oss, loop):
    """Each prompt starts with the previous prompt and answer, token for
    token (up to its call where the model wrote the call in a spelling the
    template does not render), and the cache serves all of that but the
    last partial block."""
    outs = [out for _, _, _, out in loop]
    decode = lambda ids: gpt_oss.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    shares = []
    for before, out in zip(outs, outs[1:]):
        previous = before.prompt_token_ids + before.outputs[0].token_ids
        keep = len(before.prompt_token_ids) + kept(gpt_oss, before)
        shares.append((out.num_cached_tokens, keep, len(previous)))
        where = (decode(previous), decode(out.prompt_token_ids))
        assert out.prompt_token_ids[:keep] == previous[:keep], where
        assert out.num_cached_tokens >= SHARE * keep, (out.num_cached_tokens, keep, where)
    print("\ngpt-oss GGUF: cached / previous prompt+completion (kept as written) per turn: "
          + ", ".join(f"{c}/{p} ({k}) = {c / p:.1%}" for c, k, p in shares))


def test_a_call_turn_streams_as_it_came_whole(gpt_oss, loop):
    """The second turn's tokens (a call after the first call's result) parsed
    one at a time give the message parsed whole, no marker in any delta."""
    messages, params, options, out = loop[1]
    whole = out.outputs[0]
    parser = gpt_oss.prepare_chat(messages, params, ChatOptions(**options)).parser()
    deltas = [d for t in whole.token_ids for d in parser.push([t])] + parser.finish()
    content, reasoning, calls = reassemble(deltas)
    assert (content, reasoning) == (whole.content, whole.reasoning_content)
    assert calls == [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in whole.tool_calls]
    markers = marker_texts(gpt_oss)
    for d in deltas:
        shown = (d.content or "") + (d.reasoning_content or "") + "".join(
            c["function"].get("arguments", "") for c in d.tool_calls or [])
        assert not [m for m in markers if m in shown], d


def test_newlines_the_model_writes_in_its_analysis_render_back(gpt_oss):
    """harmony writes the analysis between <|message|> and <|end|> as it is:
    newlines the model opens or ends it with belong to reasoning_content (a
    `<think>` template's own padding newlines do not), so the call turn sent
    back renders the tokens the model wrote."""
    from guided.chat.prompt import ControlEscaper, tokenize_rendered
    chat = gpt_oss.chat_format
    messages = [SYSTEM, *ASK]
    options = ChatOptions(**turn_options(0, reasoning_effort="low"))
    plan = gpt_oss.prepare_chat(messages, SamplingParams(max_tokens=80), options)
    written = ('<|channel|>analysis<|message|>\n\nLook it up.\n<|end|><|start|>assistant to=functions.get_weather'
               '<|channel|>commentary json<|message|>{"city": "Paris", "unit": "celsius"}<|call|>')
    ids = tokenize_rendered(written, chat.special, chat.tokenizer, ControlEscaper(chat.special, []))
    parser = plan.parser()
    deltas = [d for t in ids for d in parser.push([t])] + parser.finish()
    content, reasoning, calls = reassemble(deltas)
    assert (content, reasoning) == (None, "\n\nLook it up.\n")
    call = {"id": "call_1", "type": "function",
            "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}}
    again = messages + [{"role": "assistant", "content": None, "reasoning_content": reasoning, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    after = gpt_oss.prepare_chat(again, SamplingParams(max_tokens=80), options).prompt_ids
    assert after[:len(plan.prompt_ids) + len(ids)] == plan.prompt_ids + ids
