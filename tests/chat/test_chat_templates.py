"""The template matrix: every template in ../shared/chat-templates, with no
weights, and a few written for the checks real templates make
(tests/helpers/templates.py). For each: the contract probed at load,
the tool-call format detected, and that no marker text a client sends
becomes a control token; then, for a native format, the three
things that must agree byte for byte (DESIGN.md rules 5 and 6):

- the grammar (tool_choice required, a named tool, auto, parallel on and
  off) accepts the calls exactly as the template renders a past call, and
  auto also a plain answer;
- the parser reads them back, streamed token by token and whole alike, with
  ids the template takes back;
- the same for a tool whose parameters keep their types in `$defs`, as
  pydantic writes them, and calls outside that schema refused;
- a 3-turn conversation sent back as the OpenAI SDK sends it (content null
  on the call turn, results as role "tool" with the returned ids) renders,
  and each turn's prompt starts with the previous prompt and answer: the
  prefix-cache hit, each turn at least 95% unless the template itself
  re-renders the answer before it (printed with the reason and the turn).

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
from guided.chat.probe import PROBE_CALLS, PROBE_TOOLS, probe_calls
from guided.outputs import CompletionOutput, RequestOutput
from guided.sampling_params import SamplingParams
from helpers.templates import WRITTEN, assert_no_injection, template_model, template_names

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
    "vllm-tool_chat_template_llama3.2_pythonic.jinja": "it prints string values unquoted "
                                                       "(city=Paris): not a Python call",
    "vllm-tool_chat_template_toolace.jinja": "it appends a stray 'r' to every value: not a Python call",
    "written: ChatML ids checked": "it shows an assistant's calls nowhere (its ids: "
                                   "test_ids_the_template_demands)",
}


#: Known gaps, each failing today for the reason given (strict: a fix must
#: remove its entry). None now: the last two (Command R7B's thinking
#: markers, GigaChat's call after its end of message) were closed by the
#: message-format table (python/guided/chat/message_formats.py).
GAPS: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def print_matrix():
    yield
    if not ROWS:
        return
    cols = ("format", "parallel", "ids", "empty", "end", "contract", "grammar", "count", "stream", "refs", "cache",
            "note")
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
    start, end = (chat.markers.text(k, chat.special) for k in ("start", "end"))
    if state == "open":
        return r.close + end + r.after
    return start + r.empty[0] + end + r.empty[1] if r.empty else ""


def _framed(chat, answer: str) -> str:
    """An answer that is not calls as the model writes it: after what opens
    it (harmony's final channel), before what ends it (GigaChat's end of
    message, which the grammar writes; Kimi K3's response tag closed, then
    its message tag)."""
    if chat.markers is None:
        return answer
    text = lambda k: chat.markers.text(k, chat.special)  # noqa: E731
    return text("answer") + answer + text("answer_end") + text("message_end")


def _results(reply: dict) -> list[dict]:
    """The tool results for ``reply``'s calls, as the OpenAI SDK sends them."""
    return [{"role": "tool", "tool_call_id": c["id"], "content": RESULTS[c["function"]["name"]]}
            for c in reply["tool_calls"]]


def _tokens(chat, text: str) -> list[int]:
    return tokenize_rendered(text, chat.special, chat.tokenizer, ControlEscaper(chat.special, []))


def _answer_text(chat, messages: list[dict], reply: dict, prompt_text: str, fallback: str,
                 following: list[dict], tools: list[dict] = PROBE_TOOLS,
                 takes=lambda text: True) -> tuple[str, str]:
    """What the model must write for the next turn to keep the prefix: the
    template's own rendering of ``reply`` after the prompt, with the
    ``following`` messages after it as the next turn has them, up to its end
    token (or ``fallback`` where the template re-renders the turn). Where
    the grammar ``takes`` not that but the template's rendering of the reply
    as the last message (Apriel shows a past call's id, never the last
    one's), the model writes that, and the next turn re-renders it."""
    def answer(following: list[dict]) -> str | None:
        full = chat.render(normalize_messages(messages + [reply] + following, chat.tools, chat.contract),
                           tools=tools, add_generation_prompt=False)
        if not full.startswith(prompt_text):
            return None
        tail = full[len(prompt_text):]
        # every place an end token stands; the first the grammar takes the text up to (an end
        # token the grammar writes may also open a call: GigaChat's <|message_sep|>)
        cuts = sorted(i + len(text) for t in chat.special.end_ids if (text := chat.special.text(t))
                      for i in range(len(tail)) if tail.startswith(text, i))
        if not cuts:
            return ""
        return next((tail[:c] for c in cuts if takes(tail[:c])), tail[:cuts[0]])
    past = answer(following)
    if past is None:
        return fallback, "the template re-renders the generation prompt in a past turn"
    if not past:
        return fallback, "no end token after the answer"
    last = answer([]) if following else past
    if last and last != past and not takes(past) and takes(last):
        return last, "the template writes the last message otherwise than a past one"
    return past, ""


def _accepts(compiler, plan, ids: list[int], end_ids) -> bool:
    m = compiler.compile(plan.grammar.text).matcher()
    body = ids[:-1] if ids and ids[-1] in end_ids else ids
    return m.consume_tokens(body) and m.is_accepting()


def _allowed(matcher) -> set[int]:
    mask = matcher.compute_mask()
    return {32 * i + j for i, word in enumerate(mask.tolist()) if word for j in range(32) if word >> j & 1}


def _model_decides_the_count(chat, compiler, plans: dict, one_call: list[int], ends) -> str:
    """DESIGN rule 4: after a whole call the end token is allowed; where the
    template's separator between calls begins with whitespace ("\n" between
    Qwen's </tool_call> and <tool_call>), the model may write that
    whitespace and still end (a real model's newline after its last call);
    whitespace the template does not write there is refused, or leads only
    to the end: the grammar never chooses another call for the model."""
    f = chat.tools.format
    body = one_call[:-1] if one_call and one_call[-1] in ends else one_call
    sep = f.sep[0].text if f.sep and not f.close and not hasattr(f.sep[0], "role") else ""
    sep_ws = sep[:len(sep) - len(sep.lstrip())]
    for kind, plan in plans.items():
        if kind == "parallel off":
            continue
        m = compiler.compile(plan.grammar.text).matcher()
        assert m.consume_tokens(body) and _allowed(m) & ends, (kind, "no end after a whole call")
        if body and body[-1] in chat.special.end_ids:
            continue   # the call ends the turn itself (harmony's <|call|>)
        for ws in {"\n", "\n\n", " ", sep_ws} - {""}:
            m = compiler.compile(plan.grammar.text).matcher()
            taken = m.consume_tokens(body + chat.tokenizer.encode_text(ws))
            if ws == sep_ws:
                assert taken and _allowed(m) & ends, (kind, f"after a call and {ws!r} the end is refused")
            elif taken:
                leads = {t for t in _allowed(m) - set(ends)
                         if t in chat.special.control_ids or chat.tokenizer.decode([t]).strip()}
                assert not leads, (kind, f"after a call and {ws!r}, which the template does not write "
                                   "there, a call may begin")
    return "sep ws" if sep_ws else "ok"


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


def _matrix() -> list:
    """The shared templates (one skip with the reason where they are absent)
    and the ones written here."""
    shared = [pytest.param(n, marks=pytest.mark.xfail(reason=GAPS[n], strict=True)) if n in GAPS else n
              for n in NAMES] or [pytest.param("../shared/chat-templates", marks=pytest.mark.skip(
                  reason="../shared/chat-templates is absent"))]
    return shared + list(WRITTEN)


@pytest.mark.parametrize("name", _matrix())
def test_template(name, default_gguf):
    m = template_model(name, default_gguf)
    chat, compiler = m.chat, m.compiler
    fmt = chat.tools
    row = ROWS.setdefault(name, {})
    row.update(format=fmt.format.name, parallel=fmt.parallel, ids=fmt.id_style,
               empty=repr(fmt.empty_content), end=repr(fmt.end_ws),
               contract="" if chat.contract.system and not chat.contract.typed_content else chat.contract)
    assert_no_injection(chat)
    if not fmt.native:
        row["note"] = ENVELOPE_REASONS.get(name, "")
        assert name in ENVELOPE_REASONS, f"{name}: the template renders no known format"
        return
    ends = chat.special.grammar_end_ids   # (the end tokens a call writes itself are its text)
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
    fallback = reasoning_close + lead + fmt.format.render(calls[:n], chat.special) + fmt.end_ws + end_text
    takes = lambda text: _accepts(compiler, state_prompt, _tokens(chat, text), ends)  # noqa: E731
    text, note = _answer_text(chat, QUESTION, reply, state_prompt.encoded.text, fallback, _results(reply),
                              takes=takes)
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
                               reasoning_close + lead + fmt.format.render(calls[:1], chat.special) + fmt.end_ws + end_text,
                               _results(one_reply), takes=takes)
    named = _plan(chat, compiler, QUESTION, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    accepted["named"] = _accepts(compiler, named, _tokens(chat, one_text), ends)
    plain = _tokens(chat, reasoning_close + _framed(chat, ANSWER) + end_text)
    accepted["auto text"] = _accepts(compiler, plans["auto"], plain, ends)
    row["grammar"] = "ok" if all(v for k, v in accepted.items() if k != "parallel off") else accepted
    row["count"] = _model_decides_the_count(chat, compiler, {**plans, "named": named},
                                            _tokens(chat, one_text), ends)
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
    text2, note2 = _answer_text(chat, messages, answer, turn2.encoded.text,
                                close2 + _framed(chat, ANSWER) + end_text, again)
    ids2 = _tokens(chat, text2)
    answered, _ = _parse(turn2, ids2, stream=False)   # as served: the parser remembers the answer's tokens
    # (Hunyuan's template has no generation prompt: its answers begin "助手："; Apriel 1.5's
    # writes a newline before its end token, and so does the model)
    assert answered.content.rstrip().endswith(ANSWER) and not answered.tool_calls, (name, answered)
    turn3 = _plan(chat, compiler, messages + [answer] + again, tool_choice="auto")
    ratios.append(_common(turn3.prompt_ids, turn2.prompt_ids + ids2) / len(turn2.prompt_ids + ids2))
    row["refs"] = _check_refs(name, m)
    row["cache"] = " ".join(f"{r:.1%}" for r in ratios)
    # each turn is held to the bar unless the template re-renders the answer before it: a
    # later turn's reason excuses no earlier one (Qwen3.5 drops past reasoning only on turn 3)
    why = {2: note, 3: note2}
    row["note"] = note if note == note2 else "; ".join(f"turn {t}: {w}" for t, w in why.items() if w)
    for (turn, reason), ratio in zip(why.items(), ratios):
        assert reason or ratio >= 0.95, (name, f"turn {turn}", ratios)


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


@pytest.mark.parametrize("name", [n for n in WRITTEN if "ids" in n])
def test_ids_the_template_demands(name, default_gguf):
    """A template that refuses any id but 9 characters (Mistral's "Tool call
    IDs should be alphanumeric strings with length 9!") gets such ids from
    the engine where the model writes none, the text envelope included: the
    parsed calls and their results render as the next turn. Ids the model
    writes ([CALL_ID]) are 9 characters by the grammar."""
    m = template_model(name, default_gguf)
    chat, fmt = m.chat, m.chat.tools
    expected = {"written: Mistral Small 3.2 ids": ("mistral_call_id", "openai"),
                "written: Mistral ids checked, not shown": ("mistral_args", "alnum9"),
                "written: ChatML ids checked": ("text_envelope", "alnum9")}[name]
    assert (fmt.format.name, fmt.id_style) == expected
    plan = _plan(m.chat, m.compiler, QUESTION, tool_choice="required")
    calls = probe_calls(fmt.format)
    end = chat.special.text(min(chat.special.end_ids))
    whole, _ = _parse(plan, _tokens(chat, fmt.format.render(calls, chat.special) + end), stream=False)
    reply = whole.message()
    assert [c["function"]["name"] for c in reply["tool_calls"]] == ["get_weather", "get_time"]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in reply["tool_calls"]), reply
    turn2 = _plan(m.chat, m.compiler, QUESTION + [reply] + _results(reply), tool_choice="auto")
    assert "Sunny, 21 C" in turn2.encoded.text
    openai_ids = {**reply, "tool_calls": [{**c, "id": f"call_{i}abcdef0123"} for i, c in enumerate(reply["tool_calls"])]}
    with pytest.raises(ValueError, match="length 9"):
        _plan(m.chat, m.compiler, QUESTION + [openai_ids] + _results(openai_ids), tool_choice="auto")


@pytest.mark.parametrize("name, takes_none", [("written: past content split (QwQ)", False),
                                               ("Qwen-Qwen2.5-7B-Instruct.jinja", True)])
def test_null_content_of_a_past_call_turn(name, takes_none, default_gguf):
    """A call turn sent back with content null, as OpenAI clients send it:
    where the template fails on None in a past turn (QwQ-32B's `.split`),
    it gets "" (llama.cpp's requires_non_null_content); where it takes None
    (`{% if message.content %}`), the null reaches it and the prompt is the
    template's own rendering of it, byte for byte. The call turn shows in
    both, as a past turn after its results and before a later question."""
    if name not in WRITTEN and name not in NAMES:
        pytest.skip("../shared/chat-templates is absent")
    m = template_model(name, default_gguf)
    chat, fmt = m.chat, m.chat.tools
    assert (fmt.format.name, fmt.empty_content) == ("hermes", None if takes_none else "")
    call = {"id": "call_0", "name": "get_weather", "arguments": {"city": "Paris"}}
    turns = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": RESULTS["get_weather"]}]
    again = [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "And in Rome?"}]
    for messages in (turns, turns + again):
        text = _plan(chat, m.compiler, messages, tool_choice="auto").encoded.text
        assert fmt.format.render([call], chat.special) in text and RESULTS["get_weather"] in text, (name, text)
        as_sent = normalize_messages(messages, None, chat.contract)   # content null left as it came
        assert as_sent[2]["content"] is None
        if takes_none:
            assert text == chat.render(as_sent, tools=PROBE_TOOLS), name
        else:
            with pytest.raises(template_module.TemplateError, match="'None' has no attribute 'split'"):
                chat.render(as_sent, tools=PROBE_TOOLS)


#: Lazy filters: Jinja gives a generator where a template's author (and
#: llama.cpp's renderer) sees a list.
LAZY = ["tools | map(attribute='function')", "tools | map(attribute='function') | map(attribute='name')",
        "tools | selectattr('type', 'equalto', 'function')", "tools | rejectattr('type', 'equalto', 'x')",
        "[3, 1, 2] | select('odd')", "[3, 1, 2] | reject('odd')", "[1, 1, 2] | unique",
        "[1, 2, 3] | reverse", "[1, 2, 3, 4] | batch(3)", "[1, 2, 3, 4] | slice(2)",
        "tools | map(attribute='function') | map(attribute='parameters') | map(attribute='required')"]


def test_lazy_filters_are_lists():
    """`tojson` and `length` take what `map`, `select`, ... give as the list it
    stands for (DeepSeek R1's template as llama.cpp ships it writes `tools |
    map(attribute='function') | tojson(indent=4)`)."""
    from guided.chat.template import render_chat
    for expr in LAZY:
        lazy = render_chat(f"{{{{ {expr} | tojson }}}}|{{{{ {expr} | length }}}}|{{{{ {expr} | count }}}}",
                           [{"role": "user", "content": "hi"}], tools=PROBE_TOOLS)
        listed = render_chat(f"{{{{ {expr} | list | tojson }}}}|{{{{ {expr} | list | length }}}}"
                             f"|{{{{ {expr} | list | length }}}}",
                             [{"role": "user", "content": "hi"}], tools=PROBE_TOOLS)
        assert lazy == listed, expr
    text = render_chat("{{ tools | map(attribute='function') | tojson(indent=4) }}",
                       [{"role": "user", "content": "hi"}], tools=PROBE_TOOLS)
    assert json.loads(text) == [t["function"] for t in PROBE_TOOLS] and "\n    " in text


#: A tool as pydantic writes one: types in `$defs`, a string enum behind a
#: `$ref` with a description beside it, an older pydantic's one-member
#: `allOf`, refs inside the referenced objects.
DEFS_TOOL = {"type": "function", "function": {"name": "book_trip", "description": "Book a trip", "parameters": {
    "$defs": {"Cabin": {"type": "string", "enum": ["economy", "business"]},
              "Code": {"type": "string", "pattern": "^[A-Z]{2}$"},
              "Place": {"type": "object", "properties": {"city": {"type": "string"},
                                                         "country": {"$ref": "#/$defs/Code"}},
                        "required": ["city"], "additionalProperties": False}},
    "type": "object",
    "properties": {"cabin": {"$ref": "#/$defs/Cabin", "description": "Cabin class"},
                   "to": {"allOf": [{"$ref": "#/$defs/Place"}], "description": "Where to"},
                   "stops": {"type": "array", "items": {"$ref": "#/$defs/Place"}},
                   "refundable": {"type": "boolean"}},
    "required": ["cabin", "to"]}}}
DEFS_GOOD = [{"cabin": "business", "to": {"city": "Lima", "country": "PE"}, "refundable": True},
             {"cabin": "economy", "to": {"city": "Oslo"}, "stops": [{"city": "Rome", "country": "IT"}],
              "refundable": False}]
DEFS_BAD = [{"cabin": "first", "to": {"city": "Lima"}},                      # not in the enum
            {"cabin": "economy", "to": {"city": "Lima", "country": "Peru"}},  # not the pattern
            {"cabin": "economy", "to": {"town": "Lima"}}]                     # not a Place


def _check_refs(name: str, m) -> str:
    """A tool whose arguments live in `$defs` (DEFS_TOOL): the grammar takes
    the template's own rendering of valid calls, the parser reads them back,
    calls outside the schema are refused. In the formats that write one
    element per argument (Qwen3-Coder, GLM, MiniMax-M2, Seed-OSS, DeepSeek
    V3.2, pythonic), each argument's grammar is built apart from the root
    that holds the `$defs`, and objects, lists and booleans are written as
    each template prints them (Seed-OSS and LFM2.5 with `|string`)."""
    chat, fmt = m.chat, m.chat.tools
    plan = prepare_chat(chat, m.compiler.compile, QUESTION, ChatOptions(tools=[DEFS_TOOL], tool_choice="required"),
                        SamplingParams(max_tokens=512))
    close = _reasoning_prefix(chat, plan.encoded.reasoning_state)
    lead = _call_lead(fmt.call_ws, plan.encoded.generation_prompt) if chat.reasoning is None else ""
    end = chat.special.text(min(chat.special.grammar_end_ids))
    for args, valid in [(a, True) for a in DEFS_GOOD] + [(a, False) for a in DEFS_BAD]:
        call_id = (fmt.format.id_template or PROBE_CALLS[0]["id"]).format(name="book_trip", index=0)
        call = {"id": call_id, "name": "book_trip", "arguments": args}
        reply = {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": "book_trip", "arguments": json.dumps(args)}}]}
        ours = close + lead + fmt.format.render([call], chat.special) + fmt.end_ws + end
        text = _answer_text(chat, QUESTION, reply, plan.encoded.text, ours, [], tools=[DEFS_TOOL],
                            takes=lambda text: fmt.format.render([call], chat.special) in text)[0]
        ids = _tokens(chat, text)
        assert _accepts(m.compiler, plan, ids, chat.special.grammar_end_ids) == valid, (name, args, text)
        if valid:
            whole, _ = _parse(plan, ids, stream=False)
            assert [json.loads(c["function"]["arguments"]) for c in whole.tool_calls] == [args], (name, text)
    return "ok"


def test_apriel_plain_text_reasoning_is_reasoning_content(default_gguf):
    """Apriel 1.6 reasons in plain text: its generation prompt opens the block
    ("Here are my reasoning steps:"), the text ends it ("[BEGIN FINAL
    RESPONSE]"). The text before the marker is reasoning_content and the
    rest the answer, whole and token by token alike (the marker split over
    tokens anyhow); a required call comes after the marker; with reasoning
    "none" the answer starts at the marker."""
    name = "Apriel-1.6-15b-Thinker-fixed.jinja"
    if name not in NAMES:
        pytest.skip(f"{name} is absent (the shared chat templates are beside the clone)")
    m = template_model(name, default_gguf)
    chat, compiler = m.chat, m.compiler
    assert chat.markers.name == "apriel"
    plan = _plan(chat, compiler, QUESTION)
    assert plan.encoded.reasoning_state == "open"
    written = "Let me think.\nStep two: [BEGIN] is not it.\n[BEGIN FINAL RESPONSE]\nIt is sunny."
    ids = _tokens(chat, written)
    for stream in (False, True):
        reply, _ = _parse(plan, ids, stream=stream)
        assert (reply.reasoning_content, reply.content) == ("Let me think.\nStep two: [BEGIN] is not it.",
                                                           "It is sunny."), (stream, reply)
    call = probe_calls(chat.tools.format)[:1]
    required = _plan(chat, compiler, QUESTION, tool_choice="required")
    text = "Weather first.\n[BEGIN FINAL RESPONSE]\n" + chat.tools.format.render(call, chat.special)
    assert _accepts(compiler, required, _tokens(chat, text), chat.special.grammar_end_ids), text
    whole, _ = _parse(required, _tokens(chat, text), stream=False)
    assert whole.reasoning_content == "Weather first." and whole.tool_calls, whole
    quiet = _plan(chat, compiler, QUESTION, reasoning_effort="none")
    forced = compiler.compile(quiet.grammar.text).matcher().shortest_completion(64)
    assert chat.tokenizer.decode(forced).startswith("\n[BEGIN FINAL RESPONSE]\n")
