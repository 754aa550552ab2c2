"""Hybrid models through the engine, each as its family ships it (issue 53).

Tiny random models over the default model's byte-level vocabulary with
their family's markers and template (helpers/family_model.py):

- LFM2 (three gated short-convolution layers and one attention layer), as
  the GGUF llama.cpp's converter writes, on the native CPU step (its Q8_0
  blocks). Its convolutions keep each token's input in the paged cache
  (model/short_conv.py), so the prefix cache and speculation hold for it;
- Granite 4.0-H (three Mamba-2 layers and one attention layer, no rotation),
  Nemotron-H (Nemotron Nano 2's template; Mamba-2, MLP-only and attention
  blocks) and Falcon-H1 (attention and Mamba-2 side by side in each layer,
  under Qwen2.5's ChatML template with Hermes calls), as HF directories, and
  Qwen3.5 (three Gated DeltaNet layers and one gated attention layer, with
  the Qwen3 family's template) as llama.cpp's qwen35 GGUF, on the torch step.
  Their recurrent state lives in a slot per sequence (model/state_pool.py):
  the prefix cache serves it from snapshots of the state at block
  boundaries, each block computed whole from the cache (so a row's numbers
  do not depend on how its steps came), and refused drafts roll back.

What a user of a hybrid model notices:
- a four-turn agent loop: every required call validates against its tool's
  schema, the last turn answers in text, and each turn finds the previous
  turn's prompt and answer in the prefix cache (the shares printed), and
  gives the tokens an engine without the cache gives;
- a JSON-schema answer validates, at every budget;
- speculative decoding gives every turn the tokens it gave without (the
  recurrent models' states rolled back past refused drafts);
- a KV pool too small for the batch preempts sequences, every answer is the
  roomy engine's, and the blocks and state slots all come back.
"""
from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest

from guided import LLM, ChatOptions, SamplingParams
from helpers.agent_loop import cache_shares, run_loop
from helpers.families import BY_NAME
from helpers.family_model import family_directory, family_gguf
from helpers.tools import SCHEMAS

#: the least share of the previous prompt and answer a turn finds in the cache (whole blocks of 16)
SHARE = 0.9
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                          "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
#: family → (its model's layer kinds, its tool format, whether it is an HF directory, how it loads)
HYBRIDS = {"lfm2": (("conv", "conv", "full", "conv"), "lfm2", False, {}),
           "granite": (("mamba", "mamba", "full", "mamba"), "granite", True, {"dtype": "float32"}),
           "qwen3": (("delta", "delta", "full", "delta"), "hermes", False, {}),   # llama.cpp's qwen35 file
           "nemotron-nano": (("mamba", "mlp", "full", "mamba", "mlp"), "nemotron", True, {"dtype": "float32"}),
           "qwen2.5": (("hybrid",) * 3, "hermes", True, {"dtype": "float32"})}   # Falcon-H1


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid(request, tmp_path_factory, default_gguf):
    """(family, model path, its engine)."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    path = str(family_directory(family, default_gguf, root) if HYBRIDS[family][2]
               else family_gguf(family, default_gguf, root))
    llm = LLM(path, kv_cache_tokens=4096, max_num_seqs=8, **HYBRIDS[family][3])
    yield family, path, llm
    llm.close()


@pytest.fixture(scope="module")
def loop(hybrid):
    return run_loop(hybrid[2])


def test_the_model_is_the_hybrid_its_family_ships(hybrid):
    family, _, llm = hybrid
    config = llm.engine.loaded.config
    assert config.layer_types == HYBRIDS[family][0]
    assert (llm.engine.runner.native is not None) == (family == "lfm2"), "a GGUF in its blocks runs natively"
    assert llm.chat_format.tools.format.name == HYBRIDS[family][1]


def test_required_calls_validate_and_the_last_turn_answers_in_text(loop):
    for messages, _, _, out in loop[:-1]:
        reply = out.outputs[0]
        assert reply.finish_reason == "tool_calls" and reply.tool_calls, (len(messages), reply.text)
        for call in reply.tool_calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    last = loop[-1][3].outputs[0]
    assert last.tool_calls == [] and last.content, last.text


def test_each_turn_finds_the_previous_one_in_the_prefix_cache(hybrid, loop):
    """The previous prompt and answer, token for token (the answer's end token aside: the random
    model ends with the vocabulary's <|endoftext|> as often as with the template's end, which the
    template writes back), all but the last block from the cache. Recurrent models start from the
    snapshot of their state at the block boundary before the previous answer's end, or, where a
    template writes the answer back otherwise (Qwen3's reasoning, its newline before </think>), at
    the previous prompt's last boundary."""
    family, _, llm = hybrid
    outs = [out for _, _, _, out in loop]
    shares = cache_shares(outs, llm.engine.special.end_ids)
    print(f"\n{family}: cached / previous prompt+completion per turn: "
          + ", ".join(f"{c}/{p} = {c / p:.1%}" for c, p, _ in shares))
    for (cached, total, same), before in zip(shares, outs):
        assert cached >= (len(before.prompt_token_ids) - 1) // 16 * 16, (cached, total)
        if same or not BY_NAME[family].reasoning:
            assert same and cached >= SHARE * total, (cached, total, same)


def test_the_prefix_cache_changes_no_answer(hybrid, loop):
    """The same loop on an engine without the prefix cache: the same prompts and tokens, turn by
    turn (seeded sampling), none of them cached."""
    family, path, _ = hybrid
    cold = LLM(path, kv_cache_tokens=4096, enable_prefix_caching=False, **HYBRIDS[family][3])
    try:
        again = [out for *_, out in run_loop(cold)]
        assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in again] == \
            [(out.prompt_token_ids, out.outputs[0].token_ids) for *_, out in loop]
        assert all(o.num_cached_tokens == 0 for o in again)
    finally:
        cold.close()


@pytest.mark.parametrize("max_tokens", [16, 24, 60])
def test_a_json_schema_answer_validates_at_any_budget(hybrid, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=max_tokens,
                            structured_outputs={"json": PERSON})
    [out] = hybrid[2].chat([{"role": "user", "content": "A person as JSON."}], params, use_tqdm=False)
    # the answer, past any reasoning (Nemotron Nano 2's template opens its <think> block)
    jsonschema.validate(json.loads(out.outputs[0].content), PERSON)


def test_speculative_decoding_changes_no_token(hybrid, loop):
    """Every turn again with drafts, all four at once: the tokens each gave alone without. A
    recurrent model's refused drafts take its state back to before them (StatePool.drafted):
    some drafts were refused."""
    llm = hybrid[2]
    plans = [llm.prepare_chat(m, replace(p, speculative=True), ChatOptions(**o)) for m, p, o, _ in loop]
    before = {k: llm.stats()[k] for k in ("draft_steps", "draft_lookups", "draft_lookups_kept")}
    outs = llm.run_chat(plans)
    after = llm.stats()
    assert after["draft_steps"] > before["draft_steps"], "no draft was checked"
    if llm.engine.recurrent:
        assert after["draft_lookups"] - before["draft_lookups"] > after["draft_lookups_kept"] - \
            before["draft_lookups_kept"], "no draft was refused: no state was rolled back"
    assert [o.outputs[0].token_ids for o in outs] == [out.outputs[0].token_ids for _, _, _, out in loop]


def test_preemption_gives_the_roomy_engines_answers(hybrid, loop):
    """Eight seeded continuations of the last turn's prompt in a pool with room for two prompts and
    two blocks (each its own blocks: no prefix cache), so the two running outgrow it."""
    family, path, llm = hybrid
    prompt = loop[-1][3].prompt_token_ids
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=s, ignore_eos=True) for s in range(8)]

    def answers(engine):
        return [o.outputs[0].token_ids for o in engine.generate([prompt] * 8, params, use_tqdm=False)]

    tight = LLM(path, kv_cache_tokens=len(prompt) * 2 + 32, block_size=16, max_num_seqs=8,
                enable_prefix_caching=False, **HYBRIDS[family][3])
    try:
        assert answers(tight) == answers(llm)
        stats = tight.stats()
        assert stats["preemptions"] > 0, stats
        assert stats["num_free_blocks"] == stats["num_blocks"]
        states = tight.engine.runner.states
        assert states is None or not states.slot_of, "every state slot came back"
    finally:
        tight.close()
