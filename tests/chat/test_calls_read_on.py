"""Reading a calls block on from the last read (calls.ReadState) gives, at
every length the streamed text reaches, what reading that text whole
gives: generated calls (names, nested argument values with quotes, braces,
backslashes and newlines) in a JSON, an XML and a pythonic format, cut at
generated points."""
from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from guided.chat.calls import ReadState, parse_calls
from guided.chat.tool_formats import TABLE, DetectedFormat

FORMATS = {f.name: DetectedFormat(f, parallel=True, content_sep=None, empty_content=None)
           for f in TABLE if f.name in ("hermes", "qwen3_coder", "pythonic_lfm")}
TEXT = st.text(st.sampled_from('ab {}[]",:\\\n\'é'), max_size=12)
SCALARS = st.one_of(st.integers(-99, 99), st.booleans(), st.none(), TEXT)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(TEXT, inner, max_size=3)),
                      max_leaves=6)
NAMES = ("get_weather", "get_time")


@st.composite
def blocks(draw):
    """(format name, block text, tool schemas) for one to three calls."""
    name = draw(st.sampled_from(sorted(FORMATS)))
    fmt = FORMATS[name].format
    keys = draw(st.lists(st.sampled_from(["city", "when", "extra"]), min_size=1, max_size=3, unique=True))
    calls = []
    for i in range(draw(st.integers(1, 3))):
        args = {k: draw(VALUES) for k in keys}
        if name != "hermes":   # the raw-string formats: a string may not hold its own closing quote or tag
            args = {k: v.replace("<", "").replace("'", "") if isinstance(v, str) else v for k, v in args.items()}
        calls.append({"name": draw(st.sampled_from(NAMES)), "arguments": args, "id": f"c{i}"})
    schemas = {n: {"type": "object", "properties": {k: {} for k in keys}} for n in NAMES}
    return name, fmt.render(calls, None), schemas


@given(block=blocks(), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_reading_on_equals_reading_whole(block, cuts):
    name, text, schemas = block
    fmt, state = FORMATS[name], ReadState()
    for end in sorted({min(c, len(text)) for c in cuts} | {len(text)}):
        on = parse_calls(text[:end], fmt, schemas, None, state)
        whole = parse_calls(text[:end], fmt, schemas, None)
        seen = lambda r: ([(c.name, c.call_id, c.args, c.done) for c in r[0]], r[1])  # noqa: E731
        assert seen(on) == seen(whole), (name, text[:end])
    calls, ok = parse_calls(text, fmt, schemas, None, state)
    assert ok and all(c.done for c in calls)
    for call in calls:
        json.loads(call.args)
