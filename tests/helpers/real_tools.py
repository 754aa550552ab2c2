"""Tools as people write them for a real tool-calling model (descriptions,
optional parameters, enums, a date format, a free-text body), and questions
that each need one call of one of them: the material of the Qwen2.5-Coder
tests (tests/chat/test_qwen_tools.py, tests/serve/test_qwen_apis.py)."""
from __future__ import annotations

import json

import jsonschema


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS = [
    _tool("get_weather", "Get the current weather for a city",
          {"city": {"type": "string", "description": "The city name, e.g. Paris"},
           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _tool("calculate_triangle_area", "Calculate the area of a triangle given its base and height.",
          {"base": {"type": "integer", "description": "The base of the triangle."},
           "height": {"type": "integer", "description": "The height of the triangle."},
           "unit": {"type": "string", "description": "The unit of measure (defaults to 'units')."}},
          ["base", "height"]),
    _tool("convert_currency", "Convert an amount of money from one currency to another",
          {"amount": {"type": "number"}, "from_currency": {"type": "string", "description": "ISO code"},
           "to_currency": {"type": "string", "description": "ISO code"}},
          ["amount", "from_currency", "to_currency"]),
    _tool("send_email", "Send an email to one recipient",
          {"to": {"type": "string", "description": "The recipient's address"}, "subject": {"type": "string"},
           "body": {"type": "string"}}, ["to", "subject", "body"]),
    _tool("search_flights", "Search flights between two airports on a date",
          {"origin": {"type": "string", "description": "IATA code"},
           "destination": {"type": "string", "description": "IATA code"},
           "date": {"type": "string", "format": "date"}}, ["origin", "destination", "date"]),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMES = tuple(SCHEMAS)

#: Questions that each need one call (the first is BFCL's simple_python 0,
#: which today's grammar answered with seven).
ONE_CALL = [
    "Find the area of a triangle with a base of 10 units and height of 5 units.",
    "What's the weather like in Berlin right now?",
    "Email bob@example.com that the meeting moved to 3pm, subject 'Meeting'.",
    "Find me flights from SFO to JFK on 2025-03-14.",
    "What is the weather in Tokyo in fahrenheit?",
    "A triangle has base 7 and height 3. What is its area?",
]
#: A question that two calls answer
TWO_CITIES = "What's the weather in Paris and in Rome?"


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def assert_valid(name: str, arguments: str | dict, allowed=NAMES) -> None:
    """A call names an allowed tool and its arguments validate."""
    assert name in allowed, (name, allowed)
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, SCHEMAS[name])
