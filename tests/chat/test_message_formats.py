"""The message-format table's markers, read back from generated outputs:
reasoning and answer texts drawn at random (the markers' own characters,
control tokens' texts and newlines among them), written in each family's
frame, cut into tokens at random places (each piece tokenized on its own,
so a marker's text and the reasoning's may share no token boundary the
tokenizer would choose), then parsed whole and token by token. The
reasoning and the answer come back exactly, whatever the cut: harmony's
multi-token markers (`<|channel|>analysis<|message|>` …
`<|end|><|start|>assistant<|channel|>final<|message|>`), Kimi K3's tags
(`<|close|>think<|sep|><|open|>response<|sep|>` … `<|close|>response<|sep|>`
`<|close|>message<|sep|>`, their names text between tag tokens) and Apriel
1.6's text marker (`\\n[BEGIN FINAL RESPONSE]\\n`, which may start inside a
token), on the real templates' chat formats (no weights)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from guided.chat.request import ChatOptions, prepare_chat
from guided.outputs import CompletionOutput, RequestOutput
from guided.chat.message_formats import marker_items
from guided.chat.tool_formats import Lit
from guided.sampling_params import SamplingParams
from helpers.templates import template_model, template_names

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
#: the characters texts are drawn from: letters, the markers' own, control tokens' texts
ALPHABET = st.sampled_from(["a", "b", " ", "\n", "[", "]", "|", "<", ">", "analysis", "final", "assistant",
                            "<|end|>", "<|message|>", "[BEGIN", " FINAL", " RESPONSE]", "é", "日",
                            "think", "response", "message", "<|close|>", "<|sep|>"])
TEXTS = st.lists(ALPHABET, min_size=1, max_size=12).map("".join)


@pytest.fixture(scope="module")
def formats(default_gguf):
    """name → (chat format, a plan whose parser reads a free answer)."""
    out = {}
    for name in ("written: harmony (gpt-oss)", "Apriel-1.6-15b-Thinker-fixed.jinja", "Kimi-K3.jinja"):
        if not name.startswith("written:") and name not in template_names():
            continue
        m = template_model(name, default_gguf)
        plan = prepare_chat(m.chat, m.compiler.compile, QUESTION, ChatOptions(reasoning_effort="low"),
                            SamplingParams(max_tokens=512))
        out[m.chat.markers.name] = (m.chat, plan)
    return out


def _written(chat, reasoning: str, answer: str, state: str | None, cuts: list[int]) -> list[int]:
    """The output's tokens as the model writes it in the family's frame:
    control tokens by id, the texts between them (the markers' text parts
    and the reasoning and answer around them, run together) cut at ``cuts``
    and each piece tokenized as plain text (the model writes no control
    token inside its text)."""
    m = chat.markers
    parts = [*(() if state == "open" else m.start), Lit(reasoning), *m.end, *m.answer, Lit(answer), *m.answer_end,
             *m.message_end]
    runs = marker_items(tuple(parts), chat.special)
    ids: list[int] = []
    for run in runs:
        if isinstance(run, int):
            ids.append(run)
            continue
        edges = sorted({0, len(run), *(c % (len(run) + 1) for c in cuts)})
        ids += [t for a, b in zip(edges, edges[1:]) for t in chat.tokenizer.encode_text(run[a:b])]
    return ids


def _parse(plan, ids: list[int], stream: bool):
    parser = plan.parser()
    for t in ids if stream else [ids]:
        parser.push([t] if stream else t)
    sample = CompletionOutput(index=0, text="", token_ids=ids, cumulative_logprob=None, logprobs=None,
                              finish_reason="stop")
    return parser.result(RequestOutput(request_id=0, prompt=None, prompt_token_ids=[], outputs=[sample]))


@pytest.mark.parametrize("name", ["harmony", "apriel", "kimi_k3"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reasoning=TEXTS, answer=TEXTS, cuts=st.lists(st.integers(0, 400), max_size=8))
def test_reasoning_and_answer_come_back_whatever_the_tokens(name, formats, reasoning, answer, cuts):
    if name not in formats:
        pytest.skip(f"{name}'s template is in ../shared/chat-templates, which is absent")
    chat, plan = formats[name]
    end = chat.markers.text("end", chat.special)
    # a reasoning that holds its own end marker (of text) ends there, as the grammar ends it
    assume((reasoning + end).find(end) == len(reasoning))
    ids = _written(chat, reasoning, answer, plan.encoded.reasoning_state, cuts)
    for stream in (False, True):
        reply = _parse(plan, ids, stream)
        assert (reply.reasoning_content, reply.content) == (reasoning, answer), (stream, ids)
