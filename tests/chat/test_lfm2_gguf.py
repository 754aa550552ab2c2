"""LFM2, a hybrid of gated short convolutions and attention, from one GGUF (issue 53).

A tiny random Lfm2ForCausalLM (tiny_models' row: three convolution layers and
one attention layer) over the default model's byte-level vocabulary, with the
lfm2 family's markers and template, written as llama.cpp's converter writes
it (helpers/family_model.py) and loaded by ``LLM(path)`` alone, on the native
CPU step (its Q8_0 blocks). Its convolution layers keep each token's input in
the paged cache (model/short_conv.py); what a user of a hybrid model notices:

- a four-turn agent loop: every required call validates against its tool's
  schema, the last turn answers in text, and each turn finds the previous
  turn's prompt and answer in the prefix cache (the shares printed);
- a JSON-schema answer validates, at every budget the closing allows;
- speculative decoding gives every turn the tokens it gave without it;
- a KV pool too small for the batch preempts sequences, and every answer is
  the roomy engine's; the blocks all come back.
"""
from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest

from guided import LLM, ChatOptions, SamplingParams
from helpers.agent_loop import cache_shares, run_loop
from helpers.family_model import family_gguf
from helpers.tools import SCHEMAS

#: the least share of the previous prompt and answer a turn finds in the cache (whole blocks of 16)
SHARE = 0.9
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                          "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def lfm2_path(tmp_path_factory, default_gguf) -> str:
    return family_gguf("lfm2", default_gguf, tmp_path_factory.mktemp("lfm2"))


@pytest.fixture(scope="module")
def lfm2(lfm2_path):
    llm = LLM(lfm2_path, kv_cache_tokens=4096, max_num_seqs=8)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def loop(lfm2):
    return run_loop(lfm2)


def test_the_gguf_is_a_hybrid_on_the_native_step(lfm2):
    config = lfm2.engine.loaded.config
    assert config.architecture == "lfm2" and config.layer_types.count("conv") == 3, config.layer_types
    assert lfm2.engine.runner.native is not None, "a GGUF in its blocks runs natively"
    assert lfm2.chat_format.tools.format.name == "lfm2"


def test_required_calls_validate_and_the_last_turn_answers_in_text(loop):
    for messages, _, _, out in loop[:-1]:
        reply = out.outputs[0]
        assert reply.finish_reason == "tool_calls" and reply.tool_calls, (len(messages), reply.text)
        for call in reply.tool_calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    last = loop[-1][3].outputs[0]
    assert last.tool_calls == [] and last.content and "<|tool_call_start|>" not in last.content, last.text


def test_each_turn_finds_the_previous_one_in_the_prefix_cache(lfm2, loop):
    """The previous prompt and answer, token for token (the answer's end token aside: the random
    model ends with <|endoftext|> as often as with <|im_end|>, which the template writes back)."""
    shares = cache_shares([out for _, _, _, out in loop], lfm2.engine.special.end_ids)
    print("\nLFM2 GGUF: cached / previous prompt+completion per turn: "
          + ", ".join(f"{c}/{p} = {c / p:.1%}" for c, p, _ in shares))
    for cached, total, same in shares:
        assert same and cached >= SHARE * total, (cached, total)


@pytest.mark.parametrize("max_tokens", [12, 24, 60])
def test_a_json_schema_answer_validates_at_any_budget(lfm2, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=max_tokens,
                            structured_outputs={"json": PERSON})
    [out] = lfm2.chat([{"role": "user", "content": "A person as JSON."}], params, use_tqdm=False)
    jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_speculative_decoding_changes_no_token(lfm2, loop):
    plans = [lfm2.prepare_chat(m, replace(p, speculative=True), ChatOptions(**o)) for m, p, o, _ in loop]
    before = lfm2.stats()["draft_steps"]
    outs = lfm2.run_chat(plans)
    assert lfm2.stats()["draft_steps"] > before, "no draft was checked"
    assert [o.outputs[0].token_ids for o in outs] == [out.outputs[0].token_ids for _, _, _, out in loop]


def test_preemption_gives_the_roomy_engines_answers(lfm2, lfm2_path, loop):
    """Eight seeded continuations of the last turn's prompt in a pool with room for two prompts and
    two blocks (each its own blocks: no prefix cache), so the two running outgrow it."""
    prompt = loop[-1][3].prompt_token_ids
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=s, ignore_eos=True) for s in range(8)]

    def answers(llm):
        return [o.outputs[0].token_ids for o in llm.generate([prompt] * 8, params, use_tqdm=False)]

    tight = LLM(lfm2_path, kv_cache_tokens=len(prompt) * 2 + 32, block_size=16, max_num_seqs=8,
                enable_prefix_caching=False)
    try:
        assert answers(tight) == answers(lfm2)
        stats = tight.stats()
        assert stats["preemptions"] > 0, stats
        assert stats["num_free_blocks"] == stats["num_blocks"]
    finally:
        tight.close()
