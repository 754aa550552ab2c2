"""The native step's typed contract (issue 63): the model crosses into Rust as
records built with keyword arguments only (guided._native.NativeSpec,
NativeLinear, NativeMlp, NativeMoe, NativeAttention, NativeShortConv,
NativeLayer), each checked where it is built. A mistyped or missing key, an
unknown feature value, an array of the wrong kind fail there, naming what
was wrong; the feature values the architecture rows are typed by
(guided.model.layer_kinds) are exactly those the records take. Every
architecture row goes through them in tests/model/test_native_step.py."""
from __future__ import annotations

from typing import get_args

import numpy as np
import pytest

from guided import _native
from guided.model.architectures import ARCHITECTURES, Architecture
from guided.model.layer_kinds import Activation, MoEConfig, NormKind, NormPlacement, QkNorm, Scoring

SPEC = dict(hidden=8, heads=2, kv_heads=1, head_dim=4, rotary_dim=4, eps=1e-6, norms="pre", norm_kind="rms",
            qk_norm=None, qk_norm_after_rope=False, activation="silu", swiglu_alpha=1.702, swiglu_limit=7.0,
            residual_multiplier=1.0, embedding_multiplier=1.0, logit_multiplier=1.0, final_softcap=None)
FEATURES = {"norms": NormPlacement, "norm_kind": NormKind, "qk_norm": QkNorm, "activation": Activation}


def _linear(rows: int = 8, cols: int = 8) -> _native.NativeLinear:
    return _native.NativeLinear(parts=[np.ones((rows, cols), np.float32)])


def _moe(**over) -> _native.NativeMoe:
    expert = _native.NativeMlp(gate_up=_linear(16), down=_linear(8, 8))
    args = dict(router=_linear(4), scoring="softmax", top_k=2, norm_topk_prob=True, routed_scaling=1.0,
                groups=1, topk_groups=1, experts=[expert] * 4)
    return _native.NativeMoe(**{**args, **over})


def _accepted(e: ValueError) -> set[str]:
    """The values a refusal says the field takes ("... (one of a, b, c)")."""
    return set(str(e).rsplit("(one of ", 1)[1].rstrip(")").split(", "))


def test_a_mistyped_or_missing_key_is_refused_by_name():
    _native.NativeSpec(**SPEC)
    with pytest.raises(TypeError, match="'hiden'"):
        _native.NativeSpec(**{**SPEC, "hiden": 8})
    with pytest.raises(TypeError, match="missing .*'heads'"):
        _native.NativeSpec(**{k: v for k, v in SPEC.items() if k != "heads"})
    with pytest.raises(TypeError, match="'windw'"):
        _native.NativeAttention(qkv=_linear(16), o=_linear(), scale=0.5, windw=4)
    with pytest.raises(TypeError):   # keywords only: no order to get wrong
        _native.NativeMlp(_linear(16), _linear())


@pytest.mark.parametrize("field", sorted(FEATURES))
def test_the_spec_takes_exactly_the_rows_feature_values(field):
    for value in get_args(FEATURES[field]):
        _native.NativeSpec(**{**SPEC, field: value})
    with pytest.raises(ValueError, match=f"{field}: unknown 'sandwhich'") as refused:
        _native.NativeSpec(**{**SPEC, field: "sandwhich"})
    assert _accepted(refused.value) == set(get_args(FEATURES[field]))   # and no value the rows lack


def test_the_experts_take_exactly_moeconfigs_scorings():
    for value in get_args(Scoring):
        _moe(scoring=value)
        MoEConfig(4, 2, 8, scoring=value)
    with pytest.raises(ValueError, match="scoring: unknown 'softmx'") as refused:
        _moe(scoring="softmx")
    assert _accepted(refused.value) == set(get_args(Scoring))
    with pytest.raises(ValueError, match="scoring.*'softmx'"):
        MoEConfig(4, 2, 8, scoring="softmx")


def test_a_row_with_an_unknown_feature_value_is_refused_by_name():
    for arch in ARCHITECTURES:   # the rows as they are construct
        Architecture(arch.name, arch.hf_names, norms=arch.norms, norm_kind=arch.norm_kind,
                     qk_norm=arch.qk_norm, activation=arch.activation)
    for field in FEATURES:
        with pytest.raises(ValueError, match=f"llama: {field}: unknown 'sandwhich'"):
            Architecture("llama", ("LlamaForCausalLM",), **{field: "sandwhich"})


def test_a_wrong_array_or_record_names_its_field():
    with pytest.raises(TypeError, match="q_norm"):
        _native.NativeAttention(qkv=_linear(16), o=_linear(), scale=0.5, q_norm=np.ones(4, np.float64))
    with pytest.raises(TypeError, match=r"parts\[1\]"):
        _native.NativeLinear(parts=[np.ones((4, 8), np.float32), np.ones(8, np.float32)])
    with pytest.raises(ValueError, match="differ in width"):
        _native.NativeLinear(parts=[np.ones((4, 8), np.float32), np.ones((4, 6), np.float32)])
    with pytest.raises(ValueError, match="bias"):
        _native.NativeLinear(parts=[np.ones((4, 8), np.float32)], bias=np.ones(3, np.float32))
    with pytest.raises(TypeError, match="mixer"):
        _native.NativeLayer(mixer=_linear(), mlp=_native.NativeMlp(gate_up=_linear(16), down=_linear()))
    with pytest.raises(TypeError, match="mlp"):
        _native.NativeLayer(mixer=_native.NativeAttention(qkv=_linear(16), o=_linear(), scale=0.5), mlp=_linear())
