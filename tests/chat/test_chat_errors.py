"""Bad chat input fails at the boundary with a ValueError naming the field,
and the engine keeps serving."""
from __future__ import annotations

import json

import pytest

from guided import LLM, SamplingParams
from helpers.tools import ASK, TOOLS


@pytest.fixture(scope="module")
def strict_llm(tmp_path_factory):
    """The default model with a template (given as a file) that refuses any
    conversation without a system message, as some real templates do."""
    path = tmp_path_factory.mktemp("template") / "strict.jinja"
    path.write_text("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message "
                    "is required') }}{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return LLM(chat_template=str(path), max_num_seqs=8, kv_cache_tokens=4096)


@pytest.mark.parametrize("options, field", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}]},
     r"tools\[0\].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, r"tools\[0\].function.name"),
    ({"tools": TOOLS + TOOLS[:1]}, r"tools\[2\].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "minProperties": "x"}}}},
     "response_format.json_schema.schema"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]}, r"tools\[0\].function.strict"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "any", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}}}, "tool_choice.allowed_tools.mode"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "nope"}}]}}}, r"tool_choice.allowed_tools.tools\[0\]"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}},
     "tool_choice.allowed_tools.tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice.allowed_tools"),
])
def test_bad_options_name_the_field(llm, options, field):
    with pytest.raises(ValueError, match=field):
        llm.chat(ASK, SamplingParams(max_tokens=8), **options)
    assert llm.chat(ASK, SamplingParams(max_tokens=8))[0].outputs[0].finish_reason in ("stop", "length")


def test_bad_messages_name_the_field(llm):
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        llm.chat([{"content": "no role"}], SamplingParams(max_tokens=8))
    bad_call = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments"):
        llm.chat(bad_call, SamplingParams(max_tokens=8))


def test_template_that_raises_is_a_clear_error_and_the_engine_serves_on(strict_llm):
    with pytest.raises(ValueError, match="a system message is required"):
        strict_llm.chat(ASK, SamplingParams(max_tokens=8))
    [ok] = strict_llm.chat([{"role": "system", "content": "Be brief."}, *ASK], SamplingParams(max_tokens=8))
    assert ok.outputs[0].finish_reason in ("stop", "length") and ok.outputs[0].token_ids
    assert strict_llm.engine.stats()["num_running"] == 0


def test_chat_template_given_as_text_overrides(default_gguf):
    with pytest.raises(ValueError, match="chat_template"):
        LLM(default_gguf, chat_template="/no/such/template.jinja", kv_cache_tokens=1024)


def test_a_call_cut_by_the_budget_is_never_content(llm):
    """Without a tool grammar (tool_choice auto, tool_grammar off) a call the
    budget cuts is dropped, whole and streamed, not shown as text; calls
    finished before it are kept."""
    from guided import ChatOptions
    options = ChatOptions(tools=TOOLS, tool_grammar=False)
    whole = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    for text, calls in (('<tool_call>\n{"name": "get_', 0), (whole + '\n<tool_call>\n{"name": "sea', 1)):
        parser = llm.prepare_chat(ASK, SamplingParams(max_tokens=64), options).parser()
        deltas = [d for t in llm.tokenizer.encode(text) for d in parser.push([t])] + parser.finish()
        assert not any(d.content for d in deltas), (text, deltas)
        names = [c["function"]["name"] for d in deltas for c in d.tool_calls or [] if c["function"].get("name")]
        assert names == ["get_weather"] * calls, (text, deltas)


def test_a_constraint_in_the_sampling_params_is_honoured(llm):
    """vLLM's way, SamplingParams(structured_outputs=...), means the same as
    the structured_outputs option; both given and different is an error."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    reply = llm.chat(ASK, SamplingParams(max_tokens=32, structured_outputs={"json": schema}))[0].outputs[0]
    assert set(json.loads(reply.content)) == {"answer"}, reply.content
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.chat(ASK, SamplingParams(max_tokens=8, structured_outputs={"json": schema}),
                 structured_outputs={"regex": "[0-9]+"})
