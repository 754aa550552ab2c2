"""Required and named calls come back whole at every budget, on every
template of the matrix (../shared/chat-templates and the written ones);
a request that asks for no structure is never refused for its budget.

No weights: the engine's scheduler runs each template's own grammar with a
model that writes at random (equal logits, temperature 1: a uniform draw
among the tokens the grammar allows, the worst a model can do), at
max_tokens from the shortest call to +64, over seeds, with two sets of
tools: the probe's two small ones, and five as people write them (a
send_email whose subject and body are free text, enums, a date). Every
answer must parse, in the template's own format, to at least one call of a
declared tool (the named one where one is named) whose arguments validate,
and end as the model's own end would ("tool_calls"). What a real model
writes under each family's grammar is tested in test_chat_tools.py."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from guided import _native
from guided.chat.probe import PROBE_TOOLS
from guided.chat.request import ChatOptions, prepare_chat
from guided.outputs import CompletionOutput, RequestOutput
from guided.sampling_params import SamplingParams
from helpers.real_tools import TOOLS as REAL_TOOLS
from helpers.templates import WRITTEN, template_model, template_names

QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time in UTC?"}]
#: the tools, the one a named choice names, and the budgets: tokens beyond
#: the shortest call (the closing is under most pressure just above it:
#: with the real tools Qwen3's and Command R7B's templates lost calls there)
TOOL_SETS = {"probe tools": (PROBE_TOOLS, "get_time", (0, 1, 8, 24, 64)),
             "real tools": (REAL_TOOLS, "send_email", (0, 1, 4, 64))}
SEEDS = (0, 1)


def _matrix() -> list:
    names = template_names()
    return names + list(WRITTEN) if names else [pytest.param("../shared/chat-templates", marks=pytest.mark.skip(
        reason="../shared/chat-templates is absent"))]


def _add(sched: _native.Scheduler, sid: int, plan, compiler) -> list[int]:
    """``plan`` queued as the engine queues it (engine.py: the closing at the
    budget unless the plan or the request says "cut"); the tokens forced at
    its start."""
    on_length = plan.params.on_length or plan.grammar.on_length
    return sched.add_request(sid, plan.prompt_ids, plan.params, compiler.compile(plan.grammar.text),
                             close_on_length=on_length != "cut", closed_as_length=on_length == "close_as_length",
                             reasoning_end=plan.grammar.reasoning_end)


def _run(sched: _native.Scheduler, vocab: int, forced: dict[int, list[int]]
         ) -> dict[int, tuple[list[int], str | None, str | None]]:
    """Every queued request to its end (``forced``: the tokens each was
    given at the start): id → (tokens, finish_reason, error)."""
    out: dict[int, list] = {sid: [list(toks), None, None] for sid, toks in forced.items()}
    logits = np.zeros((0, vocab), np.float32)
    while (plan := sched.schedule()) is not None:
        rows = len(plan.sample_seq_ids)
        if logits.shape[0] < rows:
            logits = np.zeros((rows, vocab), np.float32)
        tokens, _, _ = sched.sample(logits[:rows])
        for ev in sched.update(tokens):
            toks = out[ev.seq_id][0]
            toks += ([ev.token] if ev.token >= 0 else []) + list(ev.forced) + list(ev.more)
            if ev.finish_reason is not None:
                out[ev.seq_id][1:] = [ev.finish_reason, ev.error]
    return out


@pytest.mark.parametrize("tool_set", TOOL_SETS)
@pytest.mark.parametrize("name", _matrix())
def test_calls_are_whole_at_every_budget(name, tool_set, default_gguf):
    m = template_model(name, default_gguf)
    chat, compiler = m.chat, m.compiler
    tools, named, extra_tokens = TOOL_SETS[tool_set]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    choices = {"required": "required", "named": {"type": "function", "function": {"name": named}}}
    sched = _native.Scheduler(num_blocks=2048, block_size=16, max_num_seqs=64, max_num_batched_tokens=8192,
                              max_model_len=4096, eos_token_ids=sorted(chat.special.end_ids))
    plans, forced = {}, {}
    for choice_name, choice in choices.items():
        options = ChatOptions(tools=tools, tool_choice=choice)
        whole = prepare_chat(chat, compiler.compile, QUESTION, options, SamplingParams(max_tokens=2048))
        least = len(compiler.compile(whole.grammar.text).matcher().shortest_completion(2048))
        for extra in extra_tokens:
            for seed in SEEDS:
                params = SamplingParams(max_tokens=least + extra, temperature=1.0, seed=seed)
                plan = prepare_chat(chat, compiler.compile, QUESTION, options, params)
                sid = len(plans)
                forced[sid] = _add(sched, sid, plan, compiler)
                plans[sid] = (choice_name, params.max_tokens, plan)
    bad = []
    for sid, (tokens, reason, error) in _run(sched, compiler.vocab_size, forced).items():
        choice_name, budget, plan = plans[sid]
        parser = plan.parser()
        parser.push(tokens)
        parser.finish()
        sample = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None,
                                  logprobs=None, finish_reason=reason)
        out = RequestOutput(request_id=sid, prompt=None, prompt_token_ids=[], outputs=[sample])
        reply = parser.result(out)
        where = f"{choice_name} at {budget} tokens: {reason} {error or ''} {chat.tokenizer.decode(tokens)[-300:]!r}"
        if len(tokens) > budget or parser.finish_reason(out) != "tool_calls" or not reply.tool_calls:
            bad.append(where)
            continue
        for call in reply.tool_calls:
            fn = call["function"]
            try:
                assert fn["name"] in schemas and (choice_name != "named" or fn["name"] == named)
                jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])
            except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
                bad.append(f"{where}: {fn} {str(exc)[:120]}")
    assert not bad, f"{len(bad)} of {len(plans)}:\n" + "\n".join(bad[:8])


#: requests that ask for no structure: the model may answer in text
UNSTRUCTURED = {"auto": {"tools": PROBE_TOOLS, "tool_choice": "auto"},
                "none": {"tools": PROBE_TOOLS, "tool_choice": "none"},
                "no tools": {}}


@pytest.mark.parametrize("name", _matrix())
def test_no_structure_is_never_refused_for_its_budget(name, default_gguf):
    """tool_choice auto or none, or no tools, at max_tokens 1 to 3: where
    the answer cannot be whole in the budget (a reasoning block the prompt
    opened still to close: Qwen3.5's, DeepSeek R1's with thinking on) it is
    cut there, as text without a grammar is, never refused; with thinking
    on too where the template has a switch. A required call that cannot fit
    is refused, saying so in terms of max_tokens."""
    m = template_model(name, default_gguf)
    chat, compiler = m.chat, m.compiler
    sched = _native.Scheduler(num_blocks=1024, block_size=16, max_num_seqs=64, max_num_batched_tokens=16384,
                              max_model_len=8192, eos_token_ids=sorted(chat.special.end_ids))
    switches = [{}] + ([{chat.thinking_switch: True}] if chat.thinking_switch else [])
    plans, forced, refused = {}, {}, []
    for label, given in UNSTRUCTURED.items():
        for kwargs in switches:
            options = ChatOptions(**given, chat_template_kwargs=kwargs or None)
            for budget in (1, 2, 3):
                where = f"{label}{' ' + str(kwargs) if kwargs else ''} at max_tokens {budget}"
                params = SamplingParams(max_tokens=budget, temperature=1.0, seed=budget)
                try:
                    plan = prepare_chat(chat, compiler.compile, QUESTION, options, params)
                    if plan.grammar is None:
                        continue   # free text: nothing to refuse
                    sid = len(plans)
                    forced[sid] = _add(sched, sid, plan, compiler)
                except ValueError as exc:
                    refused.append(f"{where}: {exc}")
                    continue
                plans[sid] = (where, budget, plan)
    assert not refused, "\n".join(refused)
    bad = []
    for sid, (tokens, reason, error) in _run(sched, compiler.vocab_size, forced).items():
        where, budget, plan = plans[sid]
        parser = plan.parser()
        parser.push(tokens)
        parser.finish()
        sample = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None, logprobs=None,
                                  finish_reason=reason)
        finish = parser.finish_reason(RequestOutput(request_id=sid, prompt=None, prompt_token_ids=[],
                                                    outputs=[sample]))
        if reason not in ("stop", "length") or error or finish == "error" or len(tokens) > budget:
            bad.append(f"{where}: {reason} {finish} {error or ''} {chat.tokenizer.decode(tokens)!r}")
    assert not bad, "\n".join(bad)
    # a required call below its shortest is refused, naming max_tokens
    plan = prepare_chat(chat, compiler.compile, QUESTION, ChatOptions(tools=PROBE_TOOLS, tool_choice="required"),
                        SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens"):
        _add(sched, len(plans), plan, compiler)


def test_gigachat_auto_ends_at_the_message_end_after_text_and_calls_from_the_start(default_gguf):
    """GigaChat 3 ends every message with <|message_sep|>, its end token, and
    writes a call as a turn of its own after it. Under tool_choice "auto" the
    end token ends the answer where the grammar may end: after text it does
    (the answer is the text), right at the start it cannot (no text yet), so
    the call turn follows. A model that writes the end token first calls; one
    that writes text first answers in text."""
    name = "GigaChat3-10B-A1.8B.jinja"
    if name not in template_names():
        pytest.skip(f"{name} is absent (the shared chat templates are beside the clone)")
    m = template_model(name, default_gguf)
    chat, compiler = m.chat, m.compiler
    sep, word = chat.special.id_of_text("<|message_sep|>"), chat.tokenizer.encode_text(" sunny")[0]
    sched = _native.Scheduler(num_blocks=256, block_size=16, max_num_seqs=4, max_num_batched_tokens=4096,
                              max_model_len=4096, eos_token_ids=sorted(chat.special.end_ids))
    params = SamplingParams(max_tokens=64, temperature=1.0, seed=0)
    plan = prepare_chat(chat, compiler.compile, QUESTION, ChatOptions(tools=PROBE_TOOLS, tool_choice="auto"), params)
    grammar = compiler.compile(plan.grammar.text)
    forced = {sid: sched.add_request(sid, plan.prompt_ids, params, grammar, close_on_length=True) for sid in (0, 1)}
    out = {sid: list(toks) for sid, toks in forced.items()}
    reasons = {}
    while (step := sched.schedule()) is not None:
        logits = np.zeros((len(step.sample_seq_ids), compiler.vocab_size), np.float32)
        for row, sid in enumerate(step.sample_seq_ids):   # 0: the end token at once; 1: text, then it
            logits[row, sep if sid == 0 or len(out[sid]) >= 3 else word] = 50.0
        tokens, _, _ = sched.sample(logits)
        for ev in sched.update(tokens):
            out[ev.seq_id] += ([ev.token] if ev.token >= 0 else []) + list(ev.forced) + list(ev.more)
            if ev.finish_reason is not None:
                reasons[ev.seq_id] = ev.finish_reason
    replies = {}
    for sid, tokens in out.items():
        parser = plan.parser()
        parser.push(tokens)
        sample = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None, logprobs=None,
                                  finish_reason=reasons[sid])
        replies[sid] = parser.result(RequestOutput(request_id=sid, prompt=None, prompt_token_ids=[],
                                                   outputs=[sample]))
    call, text = replies[0], replies[1]
    assert call.finish_reason == "tool_calls" and call.content is None, call
    jsonschema.validate(json.loads(call.tool_calls[0]["function"]["arguments"]),
                        {t["function"]["name"]: t["function"]["parameters"]
                         for t in PROBE_TOOLS}[call.tool_calls[0]["function"]["name"]])
    assert out[1] == [word] * 3 + [sep], chat.tokenizer.decode(out[1])
    assert (text.content, text.tool_calls, text.finish_reason) == (" sunny" * 3, [], "stop")
