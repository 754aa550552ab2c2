"""Hybrid and expert rows read every config field as transformers' modeling files do (issue 62).

The fixed rows of helpers/tiny_models.py pin one config each; real checkpoints differ
in the fields those rows hold equal (Granite 4.0-H's shared_intermediate_size beside
its experts' intermediate_size once failed to load). Here hypothesis draws small
configs over the fields the loaders read, for Granite 4.0-H (Mamba-2 layers, experts
or none, rotation or none, the Hub's and transformers 5's spellings of layer_types),
Granite 3's experts, Qwen3.5 / Qwen3.5-MoE / Qwen3-Next (Gated DeltaNet head shapes,
experts, dense layers), Nemotron-H (block orders, Mamba-2 shapes, biases, dt's floor, the
Hub's hybrid_override_pattern or transformers 5's layers_block_type) and LFM2 (its MLP
width adjustment, kernel, biases). A config
transformers' own validation refuses is not drawn. Each one is built by transformers,
randomised, saved as a checkpoint, loaded by guided, and its last logits compared
with transformers' within the tolerance of the fixed rows.
"""
from __future__ import annotations

import json
import os
import tempfile
from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from guided.model import load_model
from helpers.paged import last_logits
from helpers.tiny_models import VOCAB, save_tiny

transformers = pytest.importorskip("transformers")


def _common(draw, hidden: int) -> dict:
    heads = draw(st.sampled_from([2, 4]))
    return dict(vocab_size=VOCAB, hidden_size=hidden, num_attention_heads=heads,
                num_key_value_heads=draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0])),
                max_position_embeddings=512, eos_token_id=5, pad_token_id=None,
                tie_word_embeddings=draw(st.booleans()))


def _layer_types(draw, n: int, mixer: str, attention: str = "full_attention") -> list[str]:
    """n layers of either kind, at least one attention layer (transformers' forward needs one, as
    every published hybrid has)."""
    types = draw(st.lists(st.sampled_from([mixer, attention]), min_size=n, max_size=n))
    types[draw(st.integers(0, n - 1))] = attention
    return types


@st.composite
def granite_hybrid(draw):
    hidden = draw(st.sampled_from([32, 64]))
    n = draw(st.integers(2, 4))
    expand = draw(st.sampled_from([1, 2]))
    heads = draw(st.sampled_from([h for h in (2, 4, 8) if expand * hidden % h == 0]))
    experts = draw(st.sampled_from([0, 4, 8]))
    types = _layer_types(draw, n, "linear_attention")
    if draw(st.booleans()):   # the published configs' spelling
        types = ["mamba" if t == "linear_attention" else "attention" for t in types]
    multipliers = {k: draw(st.sampled_from(v)) for k, v in (("embedding_multiplier", [1.0, 2.0, 12.0]),
                                                              ("attention_multiplier", [0.0625, 0.1, 0.25]),
                                                              ("residual_multiplier", [0.22, 0.5, 1.0]),
                                                              ("logits_scaling", [1.0, 2.0, 8.0]))}
    return transformers.GraniteMoeHybridConfig(
        **_common(draw, hidden), num_hidden_layers=n, layer_types=types,
        intermediate_size=draw(st.sampled_from([32, 64, 96])),
        shared_intermediate_size=draw(st.sampled_from([32, 48, 128])),
        num_local_experts=experts, num_experts_per_tok=draw(st.integers(1, 2)) if experts else 0,
        position_embedding_type=draw(st.sampled_from(["rope", "nope"])),
        mamba_n_heads=heads, mamba_n_groups=draw(st.sampled_from([g for g in (1, 2) if heads % g == 0])),
        mamba_d_state=draw(st.sampled_from([8, 16])), mamba_d_conv=draw(st.integers(2, 4)), mamba_expand=expand,
        mamba_conv_bias=draw(st.booleans()), mamba_proj_bias=draw(st.booleans()), **multipliers)


@st.composite
def granite_moe(draw):
    hidden = draw(st.sampled_from([32, 64]))
    shared = draw(st.sampled_from([0, 48]))
    fields = dict(**_common(draw, hidden), num_hidden_layers=2, intermediate_size=draw(st.sampled_from([32, 64])),
                  num_local_experts=draw(st.sampled_from([4, 8])), num_experts_per_tok=draw(st.integers(1, 3)),
                  embedding_multiplier=2.0, attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=2.0)
    if shared:
        return transformers.GraniteMoeSharedConfig(**fields, shared_intermediate_size=shared)
    return transformers.GraniteMoeConfig(**fields)


@st.composite
def qwen3_5(draw, kind: str):
    n = draw(st.integers(2, 4))
    k_heads = draw(st.sampled_from([1, 2]))
    fields = dict(**_common(draw, 64), head_dim=draw(st.sampled_from([16, 32])), num_hidden_layers=n,
                  intermediate_size=draw(st.sampled_from([64, 96])),
                  layer_types=_layer_types(draw, n, "linear_attention"),
                  linear_num_key_heads=k_heads, linear_num_value_heads=k_heads * draw(st.sampled_from([1, 2, 4])),
                  linear_key_head_dim=draw(st.sampled_from([8, 16])),
                  linear_value_head_dim=draw(st.sampled_from([8, 16])),
                  linear_conv_kernel_dim=draw(st.integers(2, 4)),
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                   "partial_rotary_factor": draw(st.sampled_from([0.25, 0.5, 1.0]))})
    if kind == "dense":
        return transformers.Qwen3_5TextConfig(**fields)
    experts = dict(num_experts=draw(st.sampled_from([4, 8])), num_experts_per_tok=draw(st.integers(1, 2)),
                   moe_intermediate_size=draw(st.sampled_from([16, 32])),
                   shared_expert_intermediate_size=draw(st.sampled_from([32, 48])))
    if kind == "moe":
        return transformers.Qwen3_5MoeTextConfig(**fields, **experts)
    return transformers.Qwen3NextConfig(**fields, **experts, norm_topk_prob=draw(st.booleans()),
                                        decoder_sparse_step=draw(st.integers(1, 2)),
                                        mlp_only_layers=draw(st.lists(st.integers(0, n - 1), unique=True,
                                                                      max_size=n)))


@st.composite
def nemotron_h(draw):
    n = draw(st.integers(2, 5))
    types = draw(st.lists(st.sampled_from(["linear_attention", "mlp", "full_attention", "moe"]), min_size=n,
                          max_size=n))
    types[draw(st.integers(0, n - 1))] = "full_attention"
    groups = draw(st.sampled_from([1, 2]))
    # Nemotron 3's experts: grouped σ routing, a shared expert, a latent or none
    experts, routing_groups = draw(st.sampled_from([4, 8])), draw(st.sampled_from([1, 2]))
    chosen = draw(st.integers(1, routing_groups))
    moe = dict(n_routed_experts=experts, n_group=routing_groups, topk_group=chosen,
               num_experts_per_tok=draw(st.integers(1, min(2, chosen * experts // routing_groups))),
               moe_intermediate_size=draw(st.sampled_from([16, 32])),
               moe_shared_expert_intermediate_size=draw(st.sampled_from([32, 64])),
               moe_latent_size=draw(st.sampled_from([None, 32])), norm_topk_prob=draw(st.booleans()),
               routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])))
    return transformers.NemotronHConfig(**moe,
        **_common(draw, 64), num_hidden_layers=None, head_dim=draw(st.sampled_from([16, 32])), layers_block_type=types,
        intermediate_size=draw(st.sampled_from([64, 96])), mamba_num_heads=groups * draw(st.sampled_from([2, 4])),
        mamba_head_dim=draw(st.sampled_from([8, 16])), ssm_state_size=draw(st.sampled_from([8, 16])),
        n_groups=groups, conv_kernel=draw(st.integers(2, 4)), use_conv_bias=draw(st.booleans()),
        use_bias=draw(st.booleans()), attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()),
        time_step_min=draw(st.sampled_from([0.5, 0.05, 0.001])), time_step_max=1.0)


#: Nemotron-H's block characters in the Hub configs' hybrid_override_pattern
_PATTERN = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}


def _hub_spelling(directory: str, saved: dict) -> None:
    """Rewrite a saved Nemotron-H config as the published ones say it: the pattern and a layer count."""
    types = saved.pop("layers_block_type")
    saved.update(hybrid_override_pattern="".join(_PATTERN[t] for t in types), num_hidden_layers=len(types))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(saved, f)


@st.composite
def lfm2(draw):
    n = draw(st.integers(2, 4))
    auto = draw(st.booleans())
    return transformers.Lfm2Config(
        **_common(draw, 64), num_hidden_layers=n, intermediate_size=draw(st.sampled_from([96, 128, 192])),
        layer_types=_layer_types(draw, n, "conv"), conv_L_cache=draw(st.integers(2, 4)),
        conv_bias=draw(st.booleans()), block_auto_adjust_ff_dim=auto,
        block_ffn_dim_multiplier=draw(st.sampled_from([1.0, 1.5])),
        block_multiple_of=draw(st.sampled_from([16, 32])))


@st.composite
def falcon_h1(draw):
    hidden = draw(st.sampled_from([32, 64]))
    heads = draw(st.sampled_from([2, 4, 8]))
    inner = draw(st.sampled_from([None, 32, 64, 128]))      # mamba_d_ssm, else mamba_expand × hidden
    expand = draw(st.sampled_from([1, 2]))
    width = inner or expand * hidden
    multiplier = st.sampled_from([0.5, 0.8, 1.0, 1.3, 2.5])
    rms = draw(st.booleans())
    return transformers.FalconH1Config(
        **_common(draw, hidden), num_hidden_layers=draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from([8, 16])), intermediate_size=draw(st.sampled_from([48, 96])),
        mamba_d_ssm=inner, mamba_expand=expand, mamba_n_heads=heads,
        mamba_d_head=draw(st.sampled_from(["auto", width // heads])), mamba_n_groups=draw(st.sampled_from([1, 2])),
        mamba_d_state=draw(st.sampled_from([8, 16])), mamba_d_conv=draw(st.integers(2, 4)),
        mamba_conv_bias=draw(st.booleans()), mamba_proj_bias=draw(st.booleans()),
        projectors_bias=draw(st.booleans()), attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()),
        mamba_rms_norm=rms, mamba_norm_before_gate=draw(st.booleans()),
        time_step_limit=draw(st.sampled_from([(0.0, float("inf")), (0.01, 1.0)])),
        embedding_multiplier=draw(multiplier), lm_head_multiplier=draw(multiplier), key_multiplier=draw(multiplier),
        attention_in_multiplier=draw(multiplier), attention_out_multiplier=draw(multiplier),
        ssm_in_multiplier=draw(multiplier), ssm_out_multiplier=draw(multiplier),
        ssm_multipliers=[draw(multiplier) for _ in range(5)], mlp_multipliers=[draw(multiplier) for _ in range(2)])


def _valid(draw_config):
    """A strategy of the configs `draw_config` makes that transformers' validation accepts."""
    @st.composite
    def accepted(draw):
        try:
            return draw(draw_config())
        except (ValueError, TypeError, AssertionError, KeyError) as refused:
            assume(False)
            raise AssertionError("unreachable") from refused
    return accepted()


FAMILIES = {"granite_hybrid": granite_hybrid, "granite_moe": granite_moe, "qwen3_5": partial(qwen3_5, "dense"),
            "qwen3_5_moe": partial(qwen3_5, "moe"), "qwen3_next": partial(qwen3_5, "next"), "lfm2": lfm2,
            "nemotron_h": nemotron_h, "falcon_h1": falcon_h1}


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2 ** 16))
def test_generated_hybrid_configs_match_transformers(family, data, seed):
    config = data.draw(_valid(FAMILIES[family]), label="config")
    event(type(config).__name__)
    with tempfile.TemporaryDirectory() as directory:
        hf = save_tiny(directory, config, transformers.AutoModelForCausalLM.from_config, [VOCAB - 1]).float()
        with open(os.path.join(directory, "config.json")) as f:
            saved = json.load(f)
        if family == "nemotron_h" and data.draw(st.booleans(), label="hub spelling"):
            _hub_spelling(directory, saved)
        loaded = load_model(directory, dtype=torch.float32)
        ids = torch.randint(0, VOCAB - 3, (19,), generator=torch.Generator().manual_seed(seed)).tolist()
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0, -1]
        got = last_logits(loaded.model, loaded.config, ids)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4, saved
