"""Sampling on the device in the engine step (model/device_sampler.py):
the scheduler's rows as the kernels read them, the adjust and masked-sample
passes, top-logprob rows on the host. Here the kernels' CPU reference
(rust/cuda/reference.rs) stands in for them; tests/model/test_cuda_kernels.py
runs the same batch through the kernels on a GPU."""
from __future__ import annotations

import json

import jsonschema
import pytest

from guided.model.device_sampler import DeviceSampler

from helpers import sampling


def test_the_engine_step_on_the_device_path_draws_the_host_samplers_tokens(llm):
    """One seed, one stream: greedy, seeded temperature, top-k/top-p/min-p,
    penalties, bias, min_tokens bans, JSON and choice masks and a
    top-logprobs row give the same tokens, logprobs and finish reasons on
    both paths."""
    host = sampling.run(llm, None)
    device = sampling.run(llm, DeviceSampler("reference"))
    for i, (h, d) in enumerate(zip(host, device)):
        assert d.token_ids == h.token_ids, f"request {i}: {d.text!r} != {h.text!r}"
        assert d.finish_reason == h.finish_reason, i
        assert d.cumulative_logprob == pytest.approx(h.cumulative_logprob, abs=1e-2), i
    jsonschema.validate(json.loads(device[7].text), sampling.SCHEMA)
    assert device[8].text in ("Paris", "Lima", "Tokyo")
    assert len(device[6].token_ids) >= 12, "min_tokens bans the end token"
    assert device[9].logprobs and all(len(step) >= 3 for step in device[9].logprobs), \
        "the top-logprobs row kept the host path"
    assert len({tuple(o.token_ids) for o in device[1:4]}) == 3, "seeded rows drew differently"

