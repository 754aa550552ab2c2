"""Required and named calls come back whole at every budget, on every
template of the matrix (../shared/chat-templates and the written ones).

No weights: the engine's scheduler runs each template's own grammar with a
model that writes at random (equal logits, temperature 1: a uniform draw
among the tokens the grammar allows, the worst a model can do), at
max_tokens from the shortest call to +64, over seeds. Every answer must
parse, in the template's own format, to at least one call of a declared
tool (the named one where one is named) whose arguments validate, and end
as the model's own end would ("tool_calls"). What a real model writes under
each family's grammar is tested in test_chat_tools.py."""
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
from helpers.templates import WRITTEN, template_model, template_names

QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time in UTC?"}]
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_time"}}}
#: tokens beyond the shortest call, and seeds per budget
EXTRA, SEEDS = (0, 1, 8, 24, 64), (0, 1)


def _matrix() -> list:
    names = template_names()
    return names + list(WRITTEN) if names else [pytest.param("../shared/chat-templates", marks=pytest.mark.skip(
        reason="../shared/chat-templates is absent"))]


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


@pytest.mark.parametrize("name", _matrix())
def test_calls_are_whole_at_every_budget(name, default_gguf):
    m = template_model(name, default_gguf)
    chat, compiler = m.chat, m.compiler
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in PROBE_TOOLS}
    sched = _native.Scheduler(num_blocks=1024, block_size=16, max_num_seqs=64, max_num_batched_tokens=8192,
                              max_model_len=4096, eos_token_ids=sorted(chat.special.end_ids))
    plans, forced = {}, {}
    for choice_name, choice in CHOICES.items():
        options = ChatOptions(tools=PROBE_TOOLS, tool_choice=choice)
        whole = prepare_chat(chat, compiler.compile, QUESTION, options, SamplingParams(max_tokens=2048))
        least = len(compiler.compile(whole.grammar.text).matcher().shortest_completion(2048))
        for extra in EXTRA:
            for seed in SEEDS:
                params = SamplingParams(max_tokens=least + extra, temperature=1.0, seed=seed)
                plan = prepare_chat(chat, compiler.compile, QUESTION, options, params)
                sid = len(plans)
                forced[sid] = sched.add_request(sid, plan.prompt_ids, params, compiler.compile(plan.grammar.text),
                                                close_on_length=True, reasoning_end=plan.grammar.reasoning_end)
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
                assert fn["name"] in schemas and (choice_name != "named" or fn["name"] == "get_time")
                jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])
            except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
                bad.append(f"{where}: {fn} {str(exc)[:120]}")
    assert not bad, f"{len(bad)} of {len(plans)}:\n" + "\n".join(bad[:8])
