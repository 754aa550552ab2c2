"""The structured-output clients people use, against the shared live server:
instructor in its OpenAI modes and langchain-openai's
with_structured_output (json_schema and function calling).

Both refuse an answer that ends with finish_reason "length". At a budget
where the closing must act (the model would write the bio for longer), a
closed answer ends "stop" with the ``closed`` marker, and each client gets
its pydantic object; with ``on_length: "close_as_length"`` the same budget
comes back as "length", which instructor refuses.

instructor's MD_JSON mode is not here: it asks for a ```json block in free
text, which no grammar holds, so there is nothing to close (and the 135M
default model writes the schema back instead of an instance)."""
from __future__ import annotations

import instructor
import openai
import pytest
from instructor.core import IncompleteOutputException
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from helpers.live_server import API_KEY


class Person(BaseModel):
    name: str
    city: str
    bio: str


ASK = [{"role": "user", "content": "Marie Curie, a physicist from Warsaw, won two Nobel Prizes. "
                                   "Extract her name, city and a long, detailed bio."}]
#: the budget: this many tokens short of the model's own answer (at most
#: BUDGET: in a call the 135M model writes the bio on past any budget), so
#: that the closing must act
SHORT, BUDGET = 6, 40
#: what each mode sends: a named tool call (tools), response_format
#: json_schema, or json_object with the schema in the prompt (json)
MODES = [instructor.Mode.TOOLS, instructor.Mode.TOOLS_STRICT, instructor.Mode.JSON_SCHEMA,
         instructor.Mode.JSON]


@pytest.fixture(scope="module")
def base(server):
    return server + "/v1"


@pytest.fixture(scope="module")
def model(base):
    return openai.OpenAI(base_url=base, api_key=API_KEY).models.list().data[0].id


def _instructor(base, model, mode):
    """``ask(max_tokens, **kw)``: (object, completion) through instructor in ``mode``."""
    client = instructor.from_openai(openai.OpenAI(base_url=base, api_key=API_KEY, max_retries=0),
                                    mode=mode)

    def ask(max_tokens: int, **kw):
        return client.chat.completions.create_with_completion(
            model=model, response_model=Person, messages=ASK, max_tokens=max_tokens,
            temperature=0, max_retries=0, **kw)
    return ask


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_instructor_gets_its_object_at_the_budget(base, model, mode):
    ask = _instructor(base, model, mode)
    budget = min(BUDGET, ask(400)[1].usage.completion_tokens - SHORT)
    person, completion = ask(budget)
    assert isinstance(person, Person) and person.name
    choice = completion.choices[0]
    assert choice.finish_reason in ("stop", "tool_calls") and choice.closed is True, completion
    assert completion.usage.completion_tokens <= budget


def test_instructor_sees_length_where_the_client_asks_for_it(base, model):
    ask = _instructor(base, model, instructor.Mode.JSON_SCHEMA)
    budget = min(BUDGET, ask(400)[1].usage.completion_tokens - SHORT)
    with pytest.raises(IncompleteOutputException) as err:
        ask(budget, extra_body={"on_length": "close_as_length"})
    choice = err.value.last_completion.choices[0]
    assert choice.finish_reason == "length" and choice.closed is True
    Person.model_validate_json(choice.message.content)   # whole, all the same


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_at_the_budget(base, model, method):
    def ask(max_tokens: int) -> dict:
        llm = ChatOpenAI(base_url=base, api_key=API_KEY, model=model, max_tokens=max_tokens,
                         temperature=0, max_retries=0)
        return llm.with_structured_output(Person, method=method, include_raw=True).invoke(ASK)
    budget = min(BUDGET, ask(400)["raw"].usage_metadata["output_tokens"] - SHORT)
    out = ask(budget)
    assert out["parsing_error"] is None and isinstance(out["parsed"], Person), out
    meta = out["raw"].response_metadata
    assert meta["finish_reason"] in ("stop", "tool_calls"), meta
    assert out["raw"].usage_metadata["output_tokens"] <= budget
