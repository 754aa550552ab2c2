"""The closing search on generated material: random JSON schemas (required
and optional keys, open and closed objects, patterns and formats,
lengths, enums, nested objects and arrays with minItems, anyOf, $ref),
random regexes and Lark grammars (where none is found, a brute force over
short texts finds none either); from a random point the model could
reach (a walk of random tokens the grammar allows, long undeclared values
included), the completion the search returns is accepted, and the whole
text validates (jsonschema with its format checker, re.fullmatch)."""
from __future__ import annotations

import json
import re

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.structured import validator

#: Patterns and formats as tools and schemas people write use them.
PATTERNS = [r"^[A-Z]{3}$", r"^[a-z]+@[a-z]+\.com$", r"^\d{3}-\d{4}$", r"^[a-z0-9_]{3,16}$",
            r"^(red|green|blue)$", r"^\+?[0-9]{7,12}$", r"^[A-Z][a-z]+ [A-Z][a-z]+$"]
FORMATS = ["email", "date", "date-time", "uuid", "ipv4", "hostname", "uri"]
NAMES = ["name", "id", "email", "city", "to", "body", "date", "tags", "items", "x"]

#: Tokens of the random walk into the output before the search takes over.
WALK = 40
#: The longest completion looked for, in tokens.
BUDGET = 512

strings = st.one_of(
    st.just({"type": "string"}),
    st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(PATTERNS)),
    st.builds(lambda f: {"type": "string", "format": f}, st.sampled_from(FORMATS)),
    st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
              st.integers(0, 6), st.integers(0, 40)),
)
scalars = st.one_of(
    strings,
    st.builds(lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": lo + hi},
              st.integers(-50, 50), st.integers(0, 1000)),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.sampled_from(["a", "bb", 3, None, True]),
                                                min_size=1, max_size=3, unique=True)),
)


def _object(props: dict, required: list, extra) -> dict:
    out = {"type": "object", "properties": props, "required": required}
    if extra is not None:
        out["additionalProperties"] = extra
    return out


def _objects(children):
    props = st.dictionaries(st.sampled_from(NAMES), children, min_size=1, max_size=4)
    return props.flatmap(lambda p: st.builds(
        _object, st.just(p), st.lists(st.sampled_from(sorted(p)), unique=True),
        st.sampled_from([None, False, {"type": "string"}, {"type": "object"}])))


def _arrays(children):
    return st.builds(lambda items, lo: {"type": "array", "items": items, "minItems": lo},
                     children, st.integers(0, 2))


schemas = st.recursive(scalars, lambda children: st.one_of(
    _objects(children), _arrays(children),
    st.builds(lambda a, b: {"anyOf": [a, b]}, children, children)), max_leaves=8)


def _with_ref(schema: dict) -> dict:
    """The schema behind a $ref, as generated schemas often are."""
    return {"$defs": {"item": schema}, "type": "object",
            "properties": {"item": {"$ref": "#/$defs/item"}}, "required": ["item"]}


def _allowed(mask: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def _walk(llm, matcher, data) -> list[int]:
    """Random tokens the grammar allows (no end token), up to WALK of them."""
    tok = llm.engine.tokenizer
    ends = set(tok.special.end_ids)
    taken: list[int] = []
    for _ in range(data.draw(st.integers(0, WALK), label="steps")):
        if matcher.is_stopped():
            break
        allowed = [t for t in _allowed(matcher.compute_mask(), tok.vocab_size) if t not in ends]
        if not allowed:
            break
        t = int(allowed[data.draw(st.integers(0, len(allowed) - 1), label="token")])
        assert matcher.consume_token(t)
        taken.append(t)
    return taken


def _close(llm, grammar, data) -> tuple[str, list[int] | None]:
    """A random point and the search's completion from there: the text."""
    m = grammar.matcher()
    taken = _walk(llm, m, data)
    rest = m.shortest_completion(BUDGET)
    if rest is None:
        return llm.engine.tokenizer.decode(taken), None
    assert m.consume_tokens(rest) and m.is_accepting(), rest
    return llm.engine.tokenizer.decode(taken + rest), rest


SETTINGS = settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture], deadline=None)


@SETTINGS
@given(schema=schemas, ref=st.booleans(), data=st.data())
def test_a_json_schema_closes_from_any_point(llm, schema, ref, data):
    schema = _with_ref(schema) if ref else schema
    try:
        grammar = llm.compile_grammar({"json": schema})
    except ValueError:      # an unsatisfiable combination (minLength beyond a pattern, ...)
        return
    text, rest = _close(llm, grammar, data)
    assert rest is not None, f"no completion after {text!r} for {json.dumps(schema)}"
    validator(schema).validate(json.loads(text))


#: (`[0-9]`, not `\d`: which characters are Unicode digits depends on the
#: Unicode version, llguidance's newer than this Python's `re`.)
ATOMS = ["[a-z]", "[0-9]", "[A-Z]", "x", "-", "@", r"\.", "[a-c]", "[^,]"]


def _regexes():
    atom = st.sampled_from(ATOMS)
    quant = st.sampled_from(["", "+", "*", "?", "{2}", "{1,3}"])
    piece = st.builds(lambda a, q: a + q, atom, quant)
    seq = st.lists(piece, min_size=1, max_size=5).map("".join)
    return st.lists(seq, min_size=1, max_size=3).map(lambda alts: "(" + "|".join(alts) + ")") \
        .flatmap(lambda g: st.builds(lambda pre, post: pre + g + post,
                                     st.lists(piece, max_size=3).map("".join),
                                     st.lists(piece, max_size=3).map("".join)))


@SETTINGS
@given(pattern=_regexes(), data=st.data())
def test_a_regex_closes_from_any_point(llm, pattern, data):
    grammar = llm.compile_grammar({"regex": pattern})
    text, rest = _close(llm, grammar, data)
    assert rest is not None, f"no completion after {text!r} for {pattern!r}"
    assert re.fullmatch(pattern, text), (pattern, text)


#: Lark pieces: literals that delimit, and terminals, some of which may
#: swallow a delimiter (`/[a-z][^,]+/` before `">"`) and leave no completion.
LITERALS = ['"<"', '">"', '","', '":"', '"["', '"]"', '"ab"']
TERMINALS = [r"/[a-z]+/", r"/[0-9]{2}/", r"/[a-z][^,]+/", r"/x[a-c]*-/", r"/[A-Z][a-z]?/", r"/@[a-z]+\./"]


def _larks():
    """A start rule of literals, terminals and groups (?, *, +), with the
    terminals it names defined."""
    leaf = st.one_of(st.sampled_from(LITERALS), st.integers(0, len(TERMINALS) - 1).map(lambda i: f"T{i}"))
    seq = st.recursive(st.lists(leaf, min_size=1, max_size=3).map(" ".join), lambda inner: st.lists(
        st.one_of(leaf, st.builds(lambda s, q: f"({s}){q}", inner, st.sampled_from(["?", "*", "+"]))),
        min_size=1, max_size=3).map(" ".join), max_leaves=6)
    return seq.map(lambda body: f"start: {body}\n" + "".join(
        f"T{i}: {t}\n" for i, t in enumerate(TERMINALS) if f"T{i}" in body))


_CHARS: dict[int, np.ndarray] = {}


#: The characters the brute force writes: the literals' and one of each
#: terminal's classes (enough to end any lexeme the generated grammars have).
CHARS = "<>,:[]abx-@.A0"


def _char_tokens(llm) -> np.ndarray:
    """The tokens of CHARS, one character each."""
    tok = llm.engine.tokenizer
    if id(tok) not in _CHARS:
        ids = {tok.encode_text(c)[0] for c in CHARS if len(tok.encode_text(c)) == 1}
        _CHARS[id(tok)] = np.array(sorted(ids))
    return _CHARS[id(tok)]


def _exists(llm, matcher, depth: int) -> bool:
    """Brute force: whether some text of at most ``depth`` characters of
    CHARS (each a one-character token the grammar allows here) completes
    ``matcher``."""
    if matcher.is_accepting():
        return True
    if depth == 0:
        return False
    allowed = np.intersect1d(_allowed(matcher.compute_mask(), llm.engine.tokenizer.vocab_size), _char_tokens(llm))
    for t in allowed.tolist():
        if matcher.consume_token(t):
            found = _exists(llm, matcher, depth - 1)
            matcher.rollback(1)
            if found:
                return True
    return False


#: The longest completion the brute force looks for, in characters.
BRUTE_DEPTH = 3


@SETTINGS
@given(lark=_larks(), data=st.data())
def test_a_lark_grammar_closes_from_any_point_where_a_completion_exists(llm, lark, data):
    grammar = llm.compile_grammar({"grammar": lark})
    m = grammar.matcher()
    taken = _walk(llm, m, data)
    rest = m.shortest_completion(BUDGET)
    text = llm.engine.tokenizer.decode(taken)
    if rest is None:
        # none found: then none of a few characters exists either
        assert not _exists(llm, m, BRUTE_DEPTH), f"a completion exists after {text!r} for\n{lark}"
        return
    assert m.consume_tokens(rest) and m.is_accepting(), (lark, text, rest)
