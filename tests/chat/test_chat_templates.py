"""The template matrix: every template in ../shared/chat-templates, with no
weights (tests/helpers/templates.py). For each: the contract probed at load,
the tool-call format detected, and that no marker text a client sends
becomes a control token; then, for a native format, the three
things that must agree byte for byte (DESIGN.md rules 5 and 6):

- the grammar (tool_choice required, a named tool, auto, parallel on and
  off) accepts the calls exactly as the template renders a past call, and
  auto also a plain answer;
- the parser reads them back, streamed token by token and whole alike, with
  ids the template takes back;
- a 3-turn conversation sent back as the OpenAI SDK sends it (content null
  on the call turn, results as role "tool" with the returned ids) renders,
  and each turn's prompt starts with the previous prompt and answer: the
  prefix-cache hit, at least 95% unless the template itself re-renders a
  past turn (printed with the reason).

The table printed at the end is the matrix. What a real model writes under
each grammar is tested per family in test_chat_tools.py.
"""
from __future__ import annotations

import json
from datetime import datetime

import pytest

from guided.chat import template as template_module
from guided.chat.chat_format import normalize_messages
from guided.chat.parser import ChatParser
from guided.chat.prompt import ControlEscaper, tokenize_rendered
from guided.chat.request import ChatOptions, _call_lead, prepare_chat
from guided.chat.tool_formats import PROBE_TOOLS, probe_calls
from guided.outputs import CompletionOutput, RequestOutput
from guided.sampling_params import SamplingParams
from helpers.templates import assert_no_injection, template_model, template_names

NAMES = template_names()
ROWS: dict[str, dict] = {}
QUESTION = [{"role": "system", "content": "You are brief."},
            {"role": "user", "content": "What is the weather in Paris, and the time in UTC?"}]
RESULTS = {"get_weather": "Sunny, 21 C", "get_time": "12:00"}
ANSWER = "It is sunny and noon."

#: Templates whose envelope is right: they render no past call at all, or
#: only in a way no format can round-trip (the reason is printed).
ENVELOPE_REASONS = {
    "moonshotai-Kimi-K2.jinja": "the template renders only a call turn's content, never its calls",
    "Kimi-K3.jinja": "Kimi K3's tag-token format: not yet in the table",
    "vllm-tool_chat_template_llama3.2_pythonic.jinja": "it prints string values unquoted "
                                                       "(city=Paris): not a Python call",
    "vllm-tool_chat_template_toolace.jinja": "it appends a stray 'r' to every value: not a Python call",
}


#: Known gaps, each failing today for the reason given (strict: a fix must
#: remove its entry).
GAPS = {
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja":
        "its <|START_THINKING|><|END_THINKING|> before the action is not a reasoning block the "
        "registry knows, and the template ignores add_generation_prompt",
    "GigaChat3-10B-A1.8B.jinja": "its call is a turn of its own after the end-of-turn token, which "
                                 "ends generation: found as bare JSON objects, which do not round-trip",
    "unsloth-Apriel-1.5.jinja": "Apriel writes a past call's id but not the last message's: the "
                                "answer as the model writes it (no id) is not the past turn",
    "Apriel-1.6-15b-Thinker-fixed.jinja": "as Apriel 1.5, and its forced generation prompt opens a "
                                          "plain-text reasoning section",
}


@pytest.fixture(scope="module", autouse=True)
def print_matrix():
    yield
    if not ROWS:
        return
    cols = ("format", "parallel", "ids", "empty", "contract", "grammar", "stream", "cache", "note")
    print("\n\ntemplate matrix (cache: prefix hit of the previous prompt + answer, turns 2 and 3)")
    print(" | ".join(["template", *cols]))
    for name, row in sorted(ROWS.items()):
        print(" | ".join([name, *(str(row.get(c, "")) for c in cols)]))


def _plan(chat, compiler, messages, **options):
    return prepare_chat(chat, compiler.compile, messages, ChatOptions(tools=PROBE_TOOLS, **options),
                        SamplingParams(max_tokens=512))


def _reasoning_prefix(chat, state: str | None) -> str:
    """What an answer without reasoning starts with: the close of a block
    the generation prompt opened, or the empty block the template gives
    every answer (Kimi K2, GLM)."""
    r = chat.reasoning
    if r is None or state == "closed":
        return ""
    start, end = (chat.special.text(i) for i in chat.special.reasoning_ids)
    if state == "open":
        return r.close + end + r.after
    return start + r.empty[0] + end + r.empty[1] if r.empty else ""


def _results(reply: dict) -> list[dict]:
    """The tool results for ``reply``'s calls, as the OpenAI SDK sends them."""
    return [{"role": "tool", "tool_call_id": c["id"], "content": RESULTS[c["function"]["name"]]}
            for c in reply["tool_calls"]]


def _tokens(chat, text: str) -> list[int]:
    return tokenize_rendered(text, chat.special, chat.tokenizer, ControlEscaper(chat.special, []))


def _answer_text(chat, messages: list[dict], reply: dict, prompt_text: str, fallback: str,
                 following: list[dict]) -> tuple[str, str]:
    """What the model must write for the next turn to keep the prefix: the
    template's own rendering of ``reply`` after the prompt, with the
    ``following`` messages after it as the next turn has them, up to its end
    token (or ``fallback`` where the template re-renders the turn)."""
    full = chat.render(normalize_messages(messages + [reply] + following, chat.tools, chat.contract),
                       tools=PROBE_TOOLS,
                       add_generation_prompt=False)
    if not full.startswith(prompt_text):
        return fallback, "the template re-renders the generation prompt in a past turn"
    tail = full[len(prompt_text):]
    ends = [tail.find(chat.special.text(t)) for t in chat.special.end_ids]
    ends = [(i, t) for i, t in zip(ends, chat.special.end_ids) if i >= 0]
    if not ends:
        return fallback, "no end token after the answer"
    i, t = min(ends)
    return tail[:i + len(chat.special.text(t))], ""


def _accepts(compiler, plan, ids: list[int], end_ids) -> bool:
    m = compiler.compile(plan.grammar.text).matcher()
    body = ids[:-1] if ids and ids[-1] in end_ids else ids
    return m.consume_tokens(body) and m.is_accepting()


def _parse(plan, ids: list[int], stream: bool):
    parser = plan.parser()
    deltas = []
    for t in ids if stream else [ids]:
        deltas += parser.push([t] if stream else t)
    deltas += parser.finish()
    sample = CompletionOutput(index=0, text="", token_ids=ids, cumulative_logprob=None, logprobs=None,
                              finish_reason="stop")
    out = RequestOutput(request_id=0, prompt=None, prompt_token_ids=[], outputs=[sample])
    return parser.result(out), deltas


def _without_ids(message: dict) -> dict:
    """An assistant message with its calls' ids blanked (new ones each parse,
    unless the model wrote them)."""
    return {**message, "tool_calls": [{**c, "id": ""} for c in message.get("tool_calls", [])]}


class _FrozenClock(datetime):
    """One instant for the whole matrix: Hunyuan's template writes the time to
    the second into its system prompt, so turns rendered a second apart would
    share no prefix (a real cost of that template, not of the engine)."""

    @classmethod
    def now(cls, tz=None):
        return cls(2026, 1, 2, 3, 4, 5, tzinfo=tz)


@pytest.fixture(autouse=True)
def _one_instant(monkeypatch):
    monkeypatch.setattr(template_module, "datetime", _FrozenClock)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.skipif(not NAMES, reason="../shared/chat-templates is absent")
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(reason=GAPS[n], strict=True))
                                  if n in GAPS else n for n in NAMES])
def test_template(name, default_gguf):
    m = template_model(name, default_gguf)
    chat, compiler = m.chat, m.compiler
    fmt = chat.tools
    row = ROWS.setdefault(name, {})
    row.update(format=fmt.format.name, parallel=fmt.parallel, ids=fmt.id_style,
               empty=repr(fmt.empty_content),
               contract="" if chat.contract.system and not chat.contract.typed_content else chat.contract)
    assert_no_injection(chat)
    if not fmt.native:
        row["note"] = ENVELOPE_REASONS.get(name, "")
        assert name in ENVELOPE_REASONS, f"{name}: the template renders no known format"
        return
    ends = chat.special.end_ids
    calls = probe_calls(fmt.format)
    n = 2 if fmt.parallel else 1
    state_prompt = _plan(chat, compiler, QUESTION, tool_choice="required")
    reasoning_close = _reasoning_prefix(chat, state_prompt.encoded.reasoning_state)
    end_text = chat.special.text(min(ends))
    reply = {"role": "assistant", "content": None,
             "tool_calls": [{"id": c["id"], "type": "function",
                             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                            for c in calls[:n]]}
    lead = _call_lead(fmt.call_ws, state_prompt.encoded.generation_prompt) if chat.reasoning is None else ""
    fallback = reasoning_close + lead + fmt.format.render(calls[:n], chat.special) + end_text
    text, note = _answer_text(chat, QUESTION, reply, state_prompt.encoded.text, fallback, _results(reply))
    ids = _tokens(chat, text)

    # the grammar takes the template's own rendering of the calls
    plans = {"required": state_prompt,
             "auto": _plan(chat, compiler, QUESTION, tool_choice="auto")}
    if n == 2:
        plans["parallel off"] = _plan(chat, compiler, QUESTION, tool_choice="required",
                                      parallel_tool_calls=False)
    accepted = {k: _accepts(compiler, p, ids, ends) for k, p in plans.items()}
    one_reply = {**reply, "tool_calls": reply["tool_calls"][:1]}
    one_text, _ = _answer_text(chat, QUESTION, one_reply, state_prompt.encoded.text,
                               reasoning_close + lead + fmt.format.render(calls[:1], chat.special) + end_text,
                               _results(one_reply))
    named = _plan(chat, compiler, QUESTION, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    accepted["named"] = _accepts(compiler, named, _tokens(chat, one_text), ends)
    plain = _tokens(chat, reasoning_close + ANSWER + end_text)
    accepted["auto text"] = _accepts(compiler, plans["auto"], plain, ends)
    row["grammar"] = "ok" if all(v for k, v in accepted.items() if k != "parallel off") else accepted
    assert accepted["required"] and accepted["auto"] and accepted["named"], (name, text, accepted)
    assert accepted["auto text"], (name, accepted)
    if n == 2:
        assert not accepted["parallel off"], f"{name}: two calls with parallel_tool_calls false"

    # the parser reads them back, streamed and whole alike
    whole, _ = _parse(state_prompt, ids, stream=False)
    streamed, deltas = _parse(state_prompt, ids, stream=True)
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.tool_calls]
    assert got == [(c["name"], c["arguments"]) for c in calls[:n]], (name, text, whole)
    assert _without_ids(whole.message()) == _without_ids(streamed.message()), name
    assert whole.content is None and whole.finish_reason == "tool_calls", (name, whole)
    row["stream"] = "ok"

    # three turns sent back as the OpenAI SDK sends them
    messages = QUESTION + [whole.message()]
    messages += _results(whole.message())
    turn2 = _plan(chat, compiler, messages, tool_choice="auto")
    ratios = [_common(turn2.prompt_ids, state_prompt.prompt_ids + ids) / len(state_prompt.prompt_ids + ids)]
    answer = {"role": "assistant", "content": ANSWER}
    close2 = _reasoning_prefix(chat, turn2.encoded.reasoning_state)
    again = [{"role": "user", "content": "Thanks. And Rome?"}]
    text2, note2 = _answer_text(chat, messages, answer, turn2.encoded.text, close2 + ANSWER + end_text, again)
    ids2 = _tokens(chat, text2)
    answered, _ = _parse(turn2, ids2, stream=False)   # as served: the parser remembers the answer's tokens
    # (Hunyuan's template has no generation prompt: its answers begin "助手：")
    assert answered.content.endswith(ANSWER) and not answered.tool_calls, (name, answered)
    turn3 = _plan(chat, compiler, messages + [answer] + again, tool_choice="auto")
    ratios.append(_common(turn3.prompt_ids, turn2.prompt_ids + ids2) / len(turn2.prompt_ids + ids2))
    row["cache"] = " ".join(f"{r:.1%}" for r in ratios)
    row["note"] = note or note2
    if not (note or note2):
        assert min(ratios) >= 0.95, (name, ratios)


#: Two small templates written for this test (ChatML shape): one refuses a
#: system role (as Gemma's does), one reads content as a list of text parts.
NO_SYSTEM = ("{%- for m in messages -%}{%- if m.role == 'system' -%}"
             "{{ raise_exception('System role not supported') }}{%- endif -%}"
             "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor -%}"
             "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")
TYPED = ("{%- for m in messages -%}<|im_start|>{{ m.role }}\n{%- for part in m.content -%}"
         "{{ part.text }}{%- endfor -%}<|im_end|>\n{%- endfor -%}"
         "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")


@pytest.mark.parametrize("template, system, typed", [(NO_SYSTEM, False, False), (TYPED, True, True)])
def test_messages_follow_the_template_contract(template, system, typed, default_gguf):
    from guided.chat.chat_format import ChatFormat
    from guided.model.gguf_file import GGUFFile
    from guided.model.gguf_loader import gguf_tokenizer_info
    from guided.special_tokens import SpecialTokens
    from guided.tokenizer import TokenizerWrapper
    info = gguf_tokenizer_info(GGUFFile(default_gguf).metadata)
    special = SpecialTokens.classify(info["tokenizer"], info["end_token_ids"], info["bos_token"])
    chat = ChatFormat(template, special, TokenizerWrapper(info["tokenizer"], special, False), None, "<|im_end|>")
    assert (chat.contract.system, chat.contract.typed_content) == (system, typed)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    text = chat.encode(normalize_messages(messages, chat.tools, chat.contract)).text
    first = "What is 2+2?" if system else "Be brief.\n\nWhat is 2+2?"
    assert first in text
    assert text.replace("\n", "") == (("<|im_start|>systemBe brief.<|im_end|>" if system else "") + (
        f"<|im_start|>user{first}<|im_end|><|im_start|>assistant4<|im_end|>"
        "<|im_start|>userAnd 3+3?<|im_end|><|im_start|>assistant")).replace("\n", ""), text


def test_constructs_beyond_transformers_sandbox_render():
    """What other servers render and transformers' immutable sandbox refuses:
    `{% generation %}` (LFM2.5), `list.append` (Kimi K2 Thinking), `fromjson`
    (StepFun); the template's changes stay inside its render."""
    from guided.chat.template import render_chat
    messages = [{"role": "user", "content": '{"a": [1, 2]}'}]
    template = ("{% set seen = [] %}{% for m in messages %}{% generation %}{{ m.role }}:"
                "{% endgeneration %}{% set args = m.content | fromjson %}"
                "{% set _ = seen.append(args.a | length) %}{{ args.a | tojson }}{% endfor %}"
                "{{ seen | tojson }}{% set _ = messages.append(1) %}")
    assert render_chat(template, messages) == "user:[1, 2][2]" and len(messages) == 1
