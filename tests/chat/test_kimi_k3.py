"""Kimi K3's tag format (issue 60), on its own template with no weights (the
template matrix's tokenizer: the default one with K3's tag tokens added).
K3 frames a message in tags: `<|open|>think<|sep|>` the reasoning
`<|close|>think<|sep|>`, `<|open|>response<|sep|>` the answer
`<|close|>response<|sep|>`, then any calls in a tools tag, then
`<|close|>message<|sep|>` and `<|end_of_msg|>`. One message-format row
(message_formats.KIMI_K3: the calls after the answer's frame) and one
tool-format row (tool_formats' kimi_k3: each argument in its own tag with
its JSON type, calls counted from 1) are what the grammar writes, the
parser reads and the template renders back; the matrix
(test_chat_templates.py) checks the calls alone, this file the rest: the
reasoning and an answer beside the calls, thinking off, every argument
type, and `<|close|>`, which closes every tag, being no end token."""
from __future__ import annotations

import json

import pytest

from guided.chat.chat_format import normalize_messages
from guided.chat.prompt import ControlEscaper, tokenize_rendered
from guided.chat.request import ChatOptions, prepare_chat
from guided.chat.probe import PROBE_TOOLS
from guided.outputs import CompletionOutput, RequestOutput
from guided.sampling_params import SamplingParams
from guided.special_tokens import SpecialTokens
from helpers.templates import template_model, template_names

NAME = "Kimi-K3.jinja"
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time in UTC?"}]
CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_2", "type": "function",
          "function": {"name": "get_time", "arguments": '{"zone": "UTC", "hours": 24}'}}]
RESULTS = [{"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
           {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]
#: a tool with an argument of every JSON type the template names
TYPED = {"type": "function", "function": {"name": "record", "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"},
    "z": {"type": "null"}, "o": {"type": "object", "properties": {"k": {"type": "string"}}},
    "a": {"type": "array", "items": {"type": "integer"}}, "u": {"type": ["string", "null"]}},
    "required": ["s", "n"]}}}
TYPED_ARGS = {"s": "two words", "n": 3, "x": 1.5, "b": False, "z": None, "o": {"k": "v"}, "a": [1, 2], "u": None}


@pytest.fixture(scope="module")
def k3(default_gguf):
    if NAME not in template_names():
        pytest.skip(f"{NAME} is absent (the shared chat templates are beside the clone)")
    return template_model(NAME, default_gguf)


def _plan(m, messages, tools=PROBE_TOOLS, **options):
    return prepare_chat(m.chat, m.compiler.compile, messages, ChatOptions(tools=tools, **options),
                        SamplingParams(max_tokens=512))


def _tokens(chat, text: str) -> list[int]:
    return tokenize_rendered(text, chat.special, chat.tokenizer, ControlEscaper(chat.special, []))


def _written(m, plan, messages: list[dict], reply: dict, tools=PROBE_TOOLS, kwargs=None) -> list[int]:
    """What the model writes for ``reply``: the template's own rendering of
    it after the prompt, up to its end of message."""
    chat = m.chat
    full = chat.render(normalize_messages(messages + [reply], chat.tools, chat.contract), tools=tools,
                       add_generation_prompt=False, **(kwargs or {}))
    assert full.startswith(plan.encoded.text), full
    tail = full[len(plan.encoded.text):]
    return _tokens(chat, tail[:tail.index("<|end_of_msg|>") + len("<|end_of_msg|>")])


def _accepts(m, plan, ids: list[int]) -> bool:
    matcher = m.compiler.compile(plan.grammar.text).matcher()
    return matcher.consume_tokens(ids[:-1]) and matcher.is_accepting()


def _parse(plan, ids: list[int], stream: bool):
    parser = plan.parser()
    for t in ids if stream else [ids]:
        parser.push([t] if stream else t)
    sample = CompletionOutput(index=0, text="", token_ids=ids, cumulative_logprob=None, logprobs=None,
                              finish_reason="stop")
    return parser.result(RequestOutput(request_id=0, prompt=None, prompt_token_ids=[], outputs=[sample]))


def _calls(reply) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls]


def test_the_rows_and_the_end_tokens(k3):
    """The template is K3's rows; `<|close|>`, which follows every answer
    in a render, closes a tag and is no end token, even declared one;
    `<|end_of_msg|>` is, even undeclared."""
    chat = k3.chat
    assert (chat.tools.format.name, chat.markers.name, chat.tools.native) == ("kimi_k3", "kimi_k3", True)
    ends = {chat.special.text(t) for t in chat.special.end_ids}
    assert "<|end_of_msg|>" in ends and "<|close|>" not in ends, ends
    assert chat.tools.content_sep == "" and chat.reasoning.kept
    close, other = chat.special.id_of_text("<|close|>"), chat.special.id_of_text("<|im_end|>")
    declared = SpecialTokens.classify(chat.tokenizer.hf, {close, other}).with_end_ids({close})
    assert {declared.text(t) for t in declared.end_ids} >= {"<|end_of_msg|>"} and close not in declared.end_ids


@pytest.mark.parametrize("content", ["Let me look both up.", None])
def test_reasoning_an_answer_and_calls_come_back_and_render_back(k3, content):
    """Reasoning, an answer (or none) and two calls in one message, as the
    template renders them: the grammar takes them (tool_choice auto; with
    no answer, required too), the parser gives reasoning_content, content
    and the calls whole and token by token alike, and the message sent
    back renders the same tokens: the next prompt begins with this one and
    the answer."""
    reply = {"role": "assistant", "content": content, "reasoning_content": "Two tools.\nBoth now.",
             "tool_calls": CALLS}
    auto = _plan(k3, QUESTION)
    assert auto.encoded.reasoning_state == "open"
    ids = _written(k3, auto, QUESTION, reply)
    assert _accepts(k3, auto, ids)
    assert _accepts(k3, _plan(k3, QUESTION, tool_choice="required"), ids) == (content is None)
    for stream in (False, True):
        got = _parse(auto, ids, stream)
        assert (got.reasoning_content, got.content, got.finish_reason) == (reply["reasoning_content"], content,
                                                                          "tool_calls"), (stream, got)
        assert _calls(got) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC", "hours": 24})]
    turn2 = _plan(k3, QUESTION + [got.message()] + RESULTS)
    assert turn2.prompt_ids[:len(auto.prompt_ids) + len(ids)] == auto.prompt_ids + ids


def test_a_plain_answer_closes_its_tags(k3):
    """An answer in text: the response tag closed, then the message's; no
    tag's text shows."""
    plan = _plan(k3, QUESTION)
    reply = {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Easy."}
    ids = _written(k3, plan, QUESTION, reply)
    assert _accepts(k3, plan, ids)
    for stream in (False, True):
        got = _parse(plan, ids, stream)
        assert (got.reasoning_content, got.content, got.tool_calls) == ("Easy.", "It is sunny.", [])


@pytest.mark.parametrize("options", [{"chat_template_kwargs": {"thinking": False}}, {"reasoning_effort": "none"}])
def test_thinking_off_starts_inside_the_response(k3, options):
    """With thinking off (the template's switch, which reasoning_effort
    "none" turns) the generation prompt opens the response tag: the grammar
    starts inside it (no reasoning, no second opening), and text or calls
    come back as with thinking on."""
    assert k3.chat.thinking_switch == "thinking"
    kwargs = {"thinking": False}
    plan = _plan(k3, QUESTION, **options)
    assert plan.encoded.generation_prompt.endswith("<|open|>response<|sep|>")
    assert plan.encoded.reasoning_state == "closed"
    for reply in ({"role": "assistant", "content": "It is sunny."},
                  {"role": "assistant", "content": "Checking.", "tool_calls": CALLS[:1]}):
        ids = _written(k3, plan, QUESTION, reply, kwargs=kwargs)
        assert _accepts(k3, plan, ids), reply
        got = _parse(plan, ids, stream=True)
        assert (got.reasoning_content, got.content) == (None, reply["content"])
        assert _calls(got) == [("get_weather", {"city": "Paris"})] * ("tool_calls" in reply)


def test_every_argument_type(k3):
    """Each argument's tag says its JSON type (`type="number"`, `boolean`,
    `null`, `object`, `array`; an integer is a number): the grammar writes
    the type its schema gives, the parser reads the value by it."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "record", "arguments": json.dumps(TYPED_ARGS)}}
    plan = _plan(k3, QUESTION, tools=[TYPED], tool_choice="required")
    ids = _written(k3, plan, QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]}, tools=[TYPED])
    text = k3.chat.tokenizer.decode(ids)
    assert all(f'key="{k}" type="{t}"' in text for k, t in (("s", "string"), ("n", "number"), ("b", "boolean"),
                                                              ("z", "null"), ("o", "object"), ("a", "array")))
    assert _accepts(k3, plan, ids), text
    assert _calls(_parse(plan, ids, stream=True)) == [("record", TYPED_ARGS)]
