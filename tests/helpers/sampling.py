"""One batch of requests that reaches every part of the sampler: greedy,
seeded temperature, top-k/top-p/min-p, penalties, logit bias, min_tokens
bans, grammar masks (JSON schema, choice) and a row asking for top
logprobs. The device sampler's tests run it both ways (host and device)
and compare the tokens."""
from __future__ import annotations

from guided import SamplingParams

from helpers.prompts import chat

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}


def requests() -> tuple[list[str], list[SamplingParams]]:
    story = "Once upon a time, in a small village by the sea,"
    ask = chat("Name a large city and its population.")
    n = 24
    rows = [
        (story, SamplingParams(temperature=0, max_tokens=n)),
        (story, SamplingParams(temperature=0.8, seed=1, max_tokens=n)),
        (story, SamplingParams(temperature=1.0, top_k=20, seed=2, max_tokens=n)),
        (story, SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, seed=3, max_tokens=n)),
        (story, SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5,
                               presence_penalty=0.3, max_tokens=n)),
        (story, SamplingParams(temperature=0.9, seed=4, frequency_penalty=0.4, max_tokens=n,
                               logit_bias={11: 5.0, 30: -100.0, 253: 2.5})),
        (chat("Say hi."), SamplingParams(temperature=0.6, seed=5, min_tokens=12, max_tokens=n)),
        (ask, SamplingParams(temperature=0.8, seed=6, max_tokens=48,
                             structured_outputs={"json": SCHEMA})),
        (ask, SamplingParams(temperature=0, max_tokens=8,
                             structured_outputs={"choice": ["Paris", "Lima", "Tokyo"]})),
        (story, SamplingParams(temperature=0.8, seed=7, logprobs=3, max_tokens=n)),
        (story, SamplingParams(temperature=1.2, seed=8, top_k=5, repetition_penalty=1.1, max_tokens=n)),
    ]
    return [p for p, _ in rows], [s for _, s in rows]


def run(llm, sampler):
    """The batch's outputs with ``sampler`` drawing each step (None: the
    host's Rust sampler), the engine's own sampler put back after."""
    runner = llm.engine.runner
    before, runner.sampler = runner.sampler, sampler
    try:
        prompts, params = requests()
        return [o.outputs[0] for o in llm.generate(prompts, params)]
    finally:
        runner.sampler = before
