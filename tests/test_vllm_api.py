"""vLLM's documented offline examples (basic inference, structured outputs,
chat with tools) run with guided's import in place of vLLM's, and the
fields vLLM scripts read: RequestOutput.outputs, n samples, logprobs in
vLLM's shape, stop_reason, chat()'s arguments."""
from __future__ import annotations

import enum
import json
import re

import jsonschema
import pytest
from pydantic import BaseModel

from guided import LLM, SamplingParams  # as: from vllm import LLM, SamplingParams
from guided.grammar import compose
from guided.sampling_params import StructuredOutputsParams  # as: from vllm.sampling_params import ...

PROMPTS = ["Hello, my name is", "The president of the United States is",
           "The capital of France is", "The future of AI is"]


def test_offline_inference_basic(llm: LLM):
    """examples/offline_inference/basic/basic.py"""
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, seed=0)
    outputs = llm.generate(PROMPTS, sampling_params)
    assert [o.prompt for o in outputs] == PROMPTS
    for output in outputs:
        generated = output.outputs[0]
        assert len(output.outputs) == 1 and generated.index == 0
        assert generated.finish_reason in ("stop", "length") and generated.finished()
        assert generated.text == llm.tokenizer.decode(generated.token_ids)
        assert output.text == generated.text   # the pre-0.2 shorthand
        assert output.prompt_token_ids == llm.tokenizer.encode(output.prompt)
        assert generated.logprobs is None and generated.cumulative_logprob is None


def test_n_samples_share_the_prompt_and_repeat_with_a_seed(llm: LLM):
    prompt = ("Write one sentence about the sea, the sky, the wind and the stars, "
              "for a child who is about to fall asleep after a long day at the beach:")
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12)
    hits = llm.stats()["prefix_cache_hit_tokens"]
    [out] = llm.generate(prompt, params, use_tqdm=False)
    assert [s.index for s in out.outputs] == [0, 1, 2, 3]
    texts = [s.text for s in out.outputs]
    assert len(set(texts)) > 1, texts
    # sample i draws from seed + i, as vLLM's parallel sampling does
    alone = llm.generate([prompt] * 4, [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=12)
                                        for i in range(4)], use_tqdm=False)
    assert texts == [o.outputs[0].text for o in alone]
    # the samples after the first read the prompt's full blocks from the cache
    full = len(out.prompt_token_ids) // 16 * 16
    assert full >= 16 and llm.stats()["prefix_cache_hit_tokens"] - hits >= 3 * full
    [again] = llm.generate(prompt, params, use_tqdm=False)
    assert [s.text for s in again.outputs] == texts
    [greedy] = llm.generate(prompt, SamplingParams(n=3, max_tokens=8), use_tqdm=False)
    assert len({s.text for s in greedy.outputs}) == 1


class CarType(str, enum.Enum):
    sedan = "sedan"
    suv = "SUV"
    truck = "Truck"
    coupe = "Coupe"


class CarDescription(BaseModel):
    brand: str
    model: str
    car_type: CarType


SQL_GBNF = """
    root ::= select_statement
    select_statement ::= "SELECT " column " from " table " where " condition
    column ::= "col_1 " | "col_2 "
    table ::= "table_1 " | "table_2 "
    condition ::= column "= " number
    number ::= "1 " | "2 "
"""


def test_structured_outputs_example(llm: LLM):
    """examples/offline_inference/structured_outputs.py: choice, regex (with a
    stop string), a pydantic model's JSON schema, a GBNF grammar; and
    json_object."""
    schema = CarDescription.model_json_schema()
    cases = [
        (StructuredOutputsParams(choice=["Positive", "Negative"]), [],
         "Classify this sentiment: vLLM is wonderful!"),
        (StructuredOutputsParams(regex=r"\w+@\w+\.com\n"), ["\n"],
         "Generate an email address for Alan Turing, who works in Enigma. End in .com and new "
         "line. Example result: alan.turing@enigma.com\n"),
        (StructuredOutputsParams(json=schema), [],
         "Generate a JSON with the brand, model and car_type of the most iconic car from the 90's"),
        (StructuredOutputsParams(grammar=SQL_GBNF), [],
         "Generate an SQL query to show the 'username' and 'email' from the 'users' table."),
        (StructuredOutputsParams(json_object=True), [], "Describe Paris as a JSON object:"),
    ]
    outs = llm.generate([p for _, _, p in cases],
                        [SamplingParams(structured_outputs=so, stop=stop, max_tokens=96)
                         for so, stop, _ in cases], use_tqdm=False)
    choice, email, car, sql, obj = (o.outputs[0] for o in outs)
    assert choice.text in ("Positive", "Negative")
    if email.finish_reason == "stop":   # the 135M model may write \w until max_tokens
        assert re.fullmatch(r"\w+@\w+\.com", email.text) and email.stop_reason == "\n", email
    else:   # cut: what was written is where an address can still go on
        assert re.fullmatch(r"\w+(@(\w+(\.(c(om?)?)?)?)?)?", email.text), email
    jsonschema.validate(json.loads(car.text), schema)
    assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", sql.text), sql.text
    assert isinstance(json.loads(obj.text), dict)
    # the dict form is the same constraint
    [as_dict] = llm.generate(cases[2][2], SamplingParams(structured_outputs={"json": schema},
                                                          max_tokens=96), use_tqdm=False)
    assert as_dict.outputs[0].text == car.text


def test_structured_outputs_params_are_checked():
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs=StructuredOutputsParams(json={}, regex="a"))
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs=StructuredOutputsParams())
    with pytest.raises(ValueError, match="not both"):
        StructuredOutputsParams(json={}, whitespace="compact", disable_any_whitespace=True).to_dict()
    assert StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True).to_dict() == \
        {"json": {"type": "object"}, "whitespace": "compact"}
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="neither Lark"):
        compose({"grammar": "not a grammar at all"})


def test_logprobs_and_stop_reason_in_vllm_shape(llm: LLM):
    [out] = llm.generate("The capital of France is", SamplingParams(max_tokens=8, logprobs=3),
                         use_tqdm=False)
    sample = out.outputs[0]
    assert len(sample.logprobs) == len(sample.token_ids)
    for token, step in zip(sample.token_ids, sample.logprobs):
        assert step[token].rank == 1   # greedy: the sampled token is the most likely
        assert step[token].decoded_token == llm.tokenizer.decode([token], skip_special_tokens=False)
        assert 3 <= len(step) <= 4 and sorted(s.rank for s in step.values()) == [1, 2, 3]
    assert sample.cumulative_logprob == pytest.approx(
        sum(step[t].logprob for t, step in zip(sample.token_ids, sample.logprobs)))
    # a stop token id is the stop_reason; the model's own end token is not
    stopper = sample.token_ids[2]
    [cut] = llm.generate("The capital of France is", SamplingParams(max_tokens=8, stop_token_ids=[stopper]),
                         use_tqdm=False)
    upto = sample.token_ids.index(stopper) + 1
    assert cut.outputs[0].stop_reason == stopper and cut.outputs[0].token_ids == sample.token_ids[:upto]
    ended = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert ended.finish_reason == "stop" and ended.stop_reason is None


WEATHER = {"type": "function", "function": {
    "name": "get_current_weather",
    "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city to find the weather for, e.g. 'San Francisco'"},
        "state": {"type": "string", "description": "the two-letter abbreviation for the state"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "state", "unit"]}}}


def test_chat_with_tools_example(llm: LLM):
    """examples/offline_inference/chat_with_tools.py, with the call parsed
    for the script (vLLM's offline chat leaves that to it), then the tool
    loop's next turn."""
    sampling_params = SamplingParams(max_tokens=128)
    messages = [{"role": "user",
                 "content": "Can you tell me what the temperate will be in Dallas, in fahrenheit?"}]
    outputs = llm.chat(messages, sampling_params=sampling_params, tools=[WEATHER],
                       tool_choice="required", use_tqdm=False)
    reply = outputs[0].outputs[0]
    assert reply.text.strip() and reply.finish_reason == "tool_calls" and reply.tool_calls
    messages.append(reply.message())
    for call in reply.tool_calls:
        assert call["function"]["name"] == "get_current_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
        messages.append({"role": "tool", "tool_call_id": call["id"],
                         "content": json.dumps({"temperature": 98, "unit": "fahrenheit"})})
    answer = llm.chat(messages, sampling_params=sampling_params, tools=[WEATHER], tool_choice="none",
                      use_tqdm=False)[0].outputs[0]
    assert answer.content and not answer.tool_calls and answer.finish_reason in ("stop", "length")


def test_chat_takes_vllm_arguments(llm: LLM):
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    other = [{"role": "user", "content": "Name a color."}]
    greedy = SamplingParams(max_tokens=16)
    both = llm.chat([ask, other], greedy, use_tqdm=False)
    alone = [llm.chat(c, greedy, use_tqdm=False)[0] for c in (ask, other)]
    assert [o.outputs[0].text for o in both] == [o.outputs[0].text for o in alone]
    assert [o.outputs[0].content for o in both] == [o.outputs[0].text for o in both]
    assert both[0].prompt.endswith("<|im_start|>assistant\n")
    assert both[0].prompt_token_ids == llm.tokenizer.encode(both[0].prompt)

    # continue_final_message: the prompt ends inside the assistant's answer
    start = [*ask, {"role": "assistant", "content": "The capital of France is"}]
    [cont] = llm.chat(start, greedy, add_generation_prompt=False, continue_final_message=True,
                      use_tqdm=False)
    assert cont.prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    [plain] = llm.generate(cont.prompt_token_ids, greedy, use_tqdm=False)
    assert cont.outputs[0].text == plain.outputs[0].text
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(start, greedy, continue_final_message=True)
    [bare] = llm.chat(ask, greedy, add_generation_prompt=False, use_tqdm=False)
    assert bare.prompt.endswith("What is the capital of France?<|im_end|>\n")

    # a template for this call only; chat_template_kwargs reach it
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}{{ prefix }}{% endif %}")
    [own] = llm.chat(ask, greedy, chat_template=template, chat_template_kwargs={"prefix": "Answer:"},
                     use_tqdm=False)
    assert own.prompt == "user: What is the capital of France?\nAnswer:"
    assert llm.chat(ask, greedy, use_tqdm=False)[0].prompt == both[0].prompt   # the model's own again


def test_structured_outputs_in_params_are_honoured_by_every_chat_call(llm: LLM):
    ask = [{"role": "user", "content": "Describe a cat as JSON."}]
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    params = SamplingParams(max_tokens=48, structured_outputs=StructuredOutputsParams(json=schema))
    texts = [llm.chat(ask, params, use_tqdm=False)[0].outputs[0].content,
             "".join(d.content or "" for d in llm.chat_stream(ask, params))]
    with pytest.deprecated_call():
        texts.append(llm.chat_batch([ask], params)[0].content)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) == 1
    with pytest.raises(ValueError, match="differ"):
        llm.chat(ask, params, structured_outputs={"regex": "a+"})


def test_chat_reply_fields_on_the_list_are_deprecated(llm: LLM):
    ask = [{"role": "user", "content": "Say hi."}]
    outs = llm.chat(ask, SamplingParams(max_tokens=8), use_tqdm=False)
    with pytest.deprecated_call():
        assert outs.content == outs[0].outputs[0].content
    with pytest.deprecated_call():
        assert outs.output.token_ids == outs[0].outputs[0].token_ids
    with pytest.raises(AttributeError):
        outs.no_such_field  # noqa: B018
