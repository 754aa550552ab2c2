"""gpt-oss's calls in every spelling its models write (issue 60).

gpt-oss's template renders a past call one way, ` to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>`;
the models also put the recipient after the channel name, call on the
analysis channel (the peer's gpt-oss-120b: 47% of its calls) and write the
content type as `<|constrain|>json` or not at all: OpenAI's harmony format,
and the spellings llama.cpp's and vLLM's gpt-oss parsers take. Each one,
on either channel, with and without a reasoning block before it, under
tool_choice auto, required and named, is a call: the request's grammar takes
its tokens and ends there, and the parser gives back that one call (whole
and token by token alike, whatever the tokens), never content or reasoning,
with no marker text anywhere. The reasoning block and the final answer,
which begin with the same `<|channel|>`, still read as before. The
template's own spelling stays the first (the one rendered).

On the written harmony template's chat format (no weights): `<|constrain|>`
as text (the template never writes it, so the matrix's tokenizer has no
token for it) and as a token (gpt-oss's tokenizer has one).
"""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guided.chat.message_formats import marker_items
from guided.chat.probe import PROBE_TOOLS
from guided.chat.request import ChatOptions, prepare_chat
from guided.chat.tool_formats import ARGS, NAME, Lit, Special
from guided.outputs import CompletionOutput, RequestOutput
from guided.sampling_params import SamplingParams
from helpers import templates
from helpers.templates import template_model

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
HARMONY = "written: harmony (gpt-oss)"
#: the same template, naming <|constrain|> (in a comment) so that the tokenizer has it as a token
WITH_CONSTRAIN = "written: harmony (gpt-oss), <|constrain|> a token"
CHOICES = {"auto": "auto", "required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}
REASONING = "We need the weather. Call get_weather to=functions.get_time? No: commentary, analysis, final."
ARGUMENTS = {"get_weather": {"city": "Paris"}, "get_time": {"zone": "UTC", "hours": 24}}

CHANNEL, MESSAGE, CALL = Special("<|channel|>"), Special("<|message|>"), Special("<|call|>")
#: the content types: json after a space, <|constrain|>json after a space, none
TYPES = ((Lit(" json"),), (Lit(" "), Special("<|constrain|>"), Lit("json")), ())


def spelled(recipient_first: bool, channel: str, content_type: tuple) -> tuple:
    """A call as gpt-oss writes one: the recipient before the channel (in
    the header, as the template renders it) or after the channel name."""
    recipient = (Lit(" to=functions."), NAME)
    header = (*recipient, CHANNEL, Lit(channel)) if recipient_first else (CHANNEL, Lit(channel), *recipient)
    return (*header, *content_type, MESSAGE, ARGS, CALL)


#: every spelling the peers read as a call, the template's first
SPELLINGS = [spelled(first, channel, t) for first in (True, False) for channel in ("commentary", "analysis")
             for t in TYPES]


@pytest.fixture(scope="module", params=[HARMONY, WITH_CONSTRAIN])
def harmony(request, default_gguf):
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(templates.WRITTEN, WITH_CONSTRAIN, templates.WRITTEN[HARMONY] + "{#- <|constrain|> #}")
        m = template_model(request.param, default_gguf)
    constrain = m.chat.special.id_of_text("<|constrain|>")
    assert (constrain is not None) == (request.param == WITH_CONSTRAIN)
    plans = {(choice, effort): prepare_chat(m.chat, m.compiler.compile, QUESTION,
                                            ChatOptions(tools=PROBE_TOOLS, tool_choice=c, reasoning_effort=effort),
                                            SamplingParams(max_tokens=512))
             for choice, c in CHOICES.items() for effort in (None, "low", "none")}
    return m, plans


def call_parts(spelling: tuple, name: str, arguments: dict) -> tuple:
    """A call in ``spelling`` as parts: its holes filled in."""
    return tuple(Lit(name) if p is NAME else Lit(json.dumps(arguments, ensure_ascii=False)) if p is ARGS else p
                 for p in spelling)


def written(chat, parts: tuple, cuts=()) -> list[int]:
    """The tokens a model writes ``parts`` with: control tokens by id, the
    text between them cut at ``cuts`` and each piece tokenized as plain text."""
    ids: list[int] = []
    for run in marker_items(parts, chat.special):
        if isinstance(run, int):
            ids.append(run)
            continue
        edges = sorted({0, len(run), *(c % (len(run) + 1) for c in cuts)})
        ids += [t for a, b in zip(edges, edges[1:]) for t in chat.tokenizer.encode_text(run[a:b])]
    return ids


def reasoning_block(chat, text: str) -> tuple:
    m = chat.markers
    return (*m.start, Lit(text), *m.end)


def allowed(matcher) -> set[int]:
    mask = matcher.compute_mask()
    return {32 * i + j for i, word in enumerate(mask.tolist()) if word for j in range(32) if word >> j & 1}


def taken_and_ended(m, plan, ids: list[int]) -> bool:
    """The grammar takes every token and then allows nothing but the end."""
    matcher = m.compiler.compile(plan.grammar.text).matcher()
    ends = m.chat.special.grammar_end_ids
    return matcher.consume_tokens(ids) and matcher.is_accepting() and allowed(matcher) <= set(ends)


def parsed(plan, ids: list[int], stream: bool):
    parser = plan.parser()
    deltas = [d for t in ids for d in parser.push([t])] if stream else parser.push(ids)
    deltas += parser.finish()
    sample = CompletionOutput(index=0, text="", token_ids=ids, cumulative_logprob=None, logprobs=None,
                              finish_reason="stop")
    return parser.result(RequestOutput(request_id=0, prompt=None, prompt_token_ids=[], outputs=[sample])), deltas


def assert_one_call(m, plan, ids: list[int], name: str, arguments: dict, reasoning: str | None):
    """Whole and token by token alike: that call alone, the reasoning as
    written, no content; no delta shows a marker's text."""
    got = []
    for stream in (False, True):
        reply, deltas = parsed(plan, ids, stream)
        where = (stream, m.chat.tokenizer.decode(ids, skip_special_tokens=False), reply)
        assert reply.content is None and reply.finish_reason == "tool_calls", where
        assert reply.reasoning_content == reasoning, where
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls] == \
            [(name, arguments)], where
        assert "".join(d.content or "" for d in deltas) == "", where
        assert "".join(d.reasoning_content or "" for d in deltas) == (reasoning or ""), where
        assert [c["function"]["name"] for d in deltas for c in d.tool_calls or [] if "id" in c] == [name], where
        got.append([(c["function"]["name"], c["function"]["arguments"]) for c in reply.tool_calls])
    assert got[0] == got[1]


def test_the_table_has_every_spelling_the_template_s_first(harmony):
    """The row's spellings are these twelve; the first, the one it renders,
    is the template's (the matrix checks it against the template)."""
    m, _ = harmony
    fmt = m.chat.tools.format
    text = lambda spelling: "".join(p.text if isinstance(p, (Lit, Special)) else p.kind for p in spelling)  # noqa: E731
    assert [text(s) for s in fmt.spellings] == [text(s) for s in SPELLINGS]
    assert fmt.render([{"name": "get_weather", "arguments": {"city": "Paris"}, "id": ""}], m.chat.special) == \
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'


@pytest.mark.xfail(strict=True, reason="the closing's search (rust/grammar/closing.rs) takes the shortest bytes, and "
                   "the analysis channel with no content type is shorter than the template's spelling")
def test_the_closing_writes_the_template_spelling(harmony):
    """Where the closing at max_tokens writes a call the model has not
    begun, it writes it as the template renders one (a known gap)."""
    m, plans = harmony
    for choice in ("required", "named"):
        matcher = m.compiler.compile(plans[(choice, "none")].grammar.text).matcher()
        text = m.chat.tokenizer.decode(matcher.shortest_completion(200), skip_special_tokens=False)
        assert text.startswith(" to=functions.") and "<|channel|>commentary json<|message|>" in text, text


@pytest.mark.parametrize("choice", list(CHOICES))
@pytest.mark.parametrize("effort", [None, "low", "none"])
def test_every_spelling_on_every_channel_is_a_call(harmony, choice, effort):
    m, plans = harmony
    plan = plans[(choice, effort)]
    blocks = {"none": [None], "low": [REASONING], None: [None, REASONING]}[effort]
    for reasoning in blocks:
        before = reasoning_block(m.chat, reasoning) if reasoning is not None else ()
        for spelling in SPELLINGS:
            for name in (["get_weather"] if choice == "named" else list(ARGUMENTS)):
                ids = written(m.chat, before + call_parts(spelling, name, ARGUMENTS[name]))
                text = m.chat.tokenizer.decode(ids, skip_special_tokens=False)
                assert taken_and_ended(m, plan, ids), (choice, effort, text)
                assert_one_call(m, plan, ids, name, ARGUMENTS[name], reasoning)
    # a tool the named choice leaves out is refused in every spelling
    if choice == "named":
        for spelling in SPELLINGS:
            ids = written(m.chat, call_parts(spelling, "get_time", ARGUMENTS["get_time"]))
            matcher = m.compiler.compile(plan.grammar.text).matcher()
            assert not (matcher.consume_tokens(ids) and matcher.is_accepting())


def test_auto_lets_a_channel_go_on_to_a_call(harmony):
    """Under auto, `<|channel|>` may go on to `commentary` or `analysis`
    and a recipient, a call: the model is not pushed to `final`."""
    m, plans = harmony
    chat = m.chat
    channel = chat.special.id_of_text("<|channel|>")
    for effort in (None, "none"):
        for word in ("commentary to=functions.", "analysis to=functions.", "final", "analysis"):
            if effort == "none" and word == "analysis":
                continue   # the reasoning block, forbidden
            matcher = m.compiler.compile(plans[("auto", effort)].grammar.text).matcher()
            assert matcher.consume_tokens([channel] + chat.tokenizer.encode_text(word)), (effort, word)


TEXTS = st.lists(st.sampled_from(["a", " ", "\n", "to=functions.", "get_weather", "commentary", "analysis",
                                  "final", " json", "<|", "|>", "é", "{", "\""]), max_size=10).map("".join)


@settings(max_examples=60)
@given(data=st.data(), cuts=st.lists(st.integers(0, 400), max_size=10))
def test_any_spelling_any_tokens_any_arguments(harmony, data, cuts):
    """A spelling, a tool, its arguments (texts with the markers' own
    characters), a reasoning block or none, cut into tokens anywhere: the
    grammar of auto and of required takes it and ends, the parser gives
    back that call alone, streamed and whole alike."""
    m, plans = harmony
    spelling = data.draw(st.sampled_from(SPELLINGS))
    name = data.draw(st.sampled_from(sorted(ARGUMENTS)))
    arguments = {"city": data.draw(TEXTS)} if name == "get_weather" else \
        {"zone": data.draw(TEXTS), **data.draw(st.fixed_dictionaries({}, optional={"hours": st.integers(0, 99)}))}
    reasoning = data.draw(st.one_of(st.none(), TEXTS))
    before = reasoning_block(m.chat, reasoning) if reasoning is not None else ()
    ids = written(m.chat, before + call_parts(spelling, name, arguments), cuts)
    for choice in ("auto", "required"):
        plan = plans[(choice, None)]
        assert taken_and_ended(m, plan, ids), (choice, m.chat.tokenizer.decode(ids, skip_special_tokens=False))
        assert_one_call(m, plan, ids, name, arguments, reasoning or None)


@settings(max_examples=40)
@given(reasoning=TEXTS, answer=TEXTS.filter(lambda t: t.strip() and not t.startswith(" to=functions.")),
       cuts=st.lists(st.integers(0, 400), max_size=10))
def test_reasoning_and_final_answer_still_read_as_before(harmony, reasoning, answer, cuts):
    """`<|channel|>analysis<|message|>` still opens the reasoning block and
    `<|channel|>final<|message|>` the answer where calls are allowed
    (auto): texts that look like a call's spelling stay reasoning and content."""
    m, plans = harmony
    chat, plan = m.chat, plans[("auto", None)]
    ids = written(chat, (*reasoning_block(chat, reasoning), *chat.markers.answer, Lit(answer)), cuts)
    matcher = m.compiler.compile(plan.grammar.text).matcher()
    assert matcher.consume_tokens(ids) and matcher.is_accepting(), chat.tokenizer.decode(ids, skip_special_tokens=False)
    for stream in (False, True):
        reply, _ = parsed(plan, ids, stream)
        assert (reply.reasoning_content, reply.content, reply.tool_calls) == (reasoning or None, answer, []), \
            (stream, chat.tokenizer.decode(ids, skip_special_tokens=False))


def test_a_call_in_another_spelling_keeps_the_later_turns_in_the_cache(harmony):
    """A call the model wrote in another spelling comes back in the
    template's (the next prompt holds the turn up to the call); the turns
    after it come back token for token, though the model writes the
    template's texts ("commentary json") in tokens of its own: the memo of
    the model's tokens holds the call as it came back, not as written."""
    m, _ = harmony
    chat = m.chat

    def plan(messages):
        return prepare_chat(chat, m.compiler.compile, messages, ChatOptions(tools=PROBE_TOOLS, tool_choice="required"),
                            SamplingParams(max_tokens=512))

    def sent_back(messages, reply):
        call = reply.tool_calls[0]
        return messages + [reply.message(), {"role": "tool", "tool_call_id": call["id"], "content": "Sunny"}]

    every_character = list(range(400))   # each character a token: not the tokenizer's own split
    first = plan(QUESTION)
    ids1 = written(chat, reasoning_block(chat, "Look it up.")
                   + call_parts(SPELLINGS[-1], "get_weather", {"city": "Rome"}), every_character)
    reply1, _ = parsed(first, ids1, stream=True)
    second = plan(sent_back(QUESTION, reply1))
    end = len(written(chat, reasoning_block(chat, "Look it up."), every_character))
    assert second.prompt_ids[:len(first.prompt_ids) + end] == first.prompt_ids + ids1[:end]
    ids2 = written(chat, reasoning_block(chat, "Now the time.")
                   + call_parts(SPELLINGS[0], "get_time", {"zone": "UTC"}), every_character)
    reply2, _ = parsed(second, ids2, stream=False)
    third = plan(sent_back(sent_back(QUESTION, reply1), reply2))
    assert third.prompt_ids[:len(second.prompt_ids) + len(ids2)] == second.prompt_ids + ids2
