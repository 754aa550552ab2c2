"""What one model's chat template does, found once at load by rendering
probe conversations: the token that ends a turn, the tool-call format, how
reasoning is laid out, and whether the template has a thinking switch.

``ChatFormat.encode`` turns a client's conversation into prompt ids (text is
never control) and says whether the generation prompt opened or closed a
reasoning block.
"""
from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, replace

from ..special_tokens import SpecialTokens
from ..tokenizer import TokenizerWrapper
from .prompt import CompletionMemo, ControlEscaper, strings_in, tokenize_rendered
from .template import TemplateError, render_chat
from .probe import PROBE_TOOLS, detect, openai_calls, probe_calls
from .message_formats import MessageFormat, find, text_only
from .tool_formats import TEXT_ENVELOPE, DetectedFormat

log = logging.getLogger("guided.chat")

_PROBE_ANSWER = "The answer is 42."
_PROBE_REASONING = "First, think."


@dataclass(frozen=True)
class ReasoningLayout:
    """The whitespace around reasoning: `<think>{open}…{close}</think>{after}`.
    ``kept``: the template re-renders a last turn's reasoning this way, so a
    reasoning block can round-trip through the prefix cache."""

    open: str = "\n"
    close: str = "\n"
    after: str = "\n\n"
    kept: bool = False
    #: (inside, after): the empty block a past answer without reasoning gets
    #: (Kimi K2's `<think></think>`, GLM's), or None where it gets none
    empty: tuple[str, str] | None = None


@dataclass(frozen=True)
class TemplateContract:
    """What a template takes, probed once at load (as llama.cpp probes its
    templates' capabilities); messages are normalised to it."""

    system: bool = True          # a system message (else it opens the first user message)
    typed_content: bool = False  # content as a list of text parts, never a string
    #: the message field a past turn's reasoning is read from (gpt-oss's
    #: template reads "thinking"); a client's reasoning_content moves there
    reasoning_key: str = "reasoning_content"


@dataclass(frozen=True)
class EncodedChat:
    ids: list[int]
    text: str
    generation_prompt: str
    #: "open": the generation prompt ends inside a reasoning block; "closed": it
    #: holds a whole (empty) one; None: no reasoning block in it.
    reasoning_state: str | None


class ChatFormat:
    def __init__(self, template: str, special: SpecialTokens, tokenizer: TokenizerWrapper,
                 bos_token: str | None, eos_token: str | None):
        self.template = template
        self.tokenizer = tokenizer
        self._tokens = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self.special = special.with_end_ids(self._turn_end_ids(special))
        self.contract = self._probe_contract()
        self.thinking_switch = self._thinking_switch()
        #: the message-format row whose markers this model has, if any
        self.markers: MessageFormat | None = find(self.special, template)
        self.tools: DetectedFormat = detect(self._render_probe, self.special, self._before_calls())
        self.reasoning = self._reasoning_layout() if self.markers and self.markers.reasoning else None
        self.memo = CompletionMemo()

    # -- rendering -----------------------------------------------------

    def render(self, messages: list[dict], *, tools=None, documents=None,
               add_generation_prompt: bool = True, **kwargs) -> str:
        extra = {k: v for k, v in (("tools", tools), ("documents", documents)) if v}
        return render_chat(self.template, messages, add_generation_prompt=add_generation_prompt,
                           **self._tokens, **extra, **kwargs)

    def encode(self, messages: list[dict], *, tools=None, documents=None,
               kwargs: dict | None = None, prompt: str = "generate") -> EncodedChat:
        """Prompt ids for a client's conversation (already normalised).

        ``prompt``: "generate" ends with the template's generation prompt (a
        new assistant turn); "continue" ends where the final assistant
        message's content ends, so the model continues it (vLLM's
        continue_final_message); "none" ends after the last message (vLLM's
        add_generation_prompt=False). Only "generate" can open a reasoning
        block: the others count as past it."""
        kwargs = kwargs or {}
        escaper = ControlEscaper(self.special, strings_in([messages, tools, documents, kwargs]))
        msgs, tls, docs, kw = (escaper.escape(x) for x in (messages, tools, documents, kwargs))
        without = self.render(msgs, tools=tls, documents=docs, add_generation_prompt=False, **kw)
        if prompt != "generate":
            text = self._continued(without, msgs) if prompt == "continue" else without
            ids = tokenize_rendered(text, self.special, self.tokenizer, escaper, self.memo)
            return EncodedChat(ids, escaper.unescape(text), "", "closed" if self.reasoning else None)
        with_prompt = self.render(msgs, tools=tls, documents=docs, **kw)
        eos = self._tokens["eos_token"]
        if eos and without.endswith(eos) and not with_prompt.startswith(without):
            without = without[:-len(eos)]   # closed with eos_token when no answer follows (Phi-4-mini)
        if not with_prompt.startswith(without):
            raise TemplateError("the chat template's generation prompt is not a suffix of the "
                                "conversation it renders; cannot tell where the answer starts")
        generation_prompt = with_prompt[len(without):]
        ids = tokenize_rendered(with_prompt, self.special, self.tokenizer, escaper, self.memo)
        return EncodedChat(ids, escaper.unescape(with_prompt), escaper.unescape(generation_prompt),
                           self._reasoning_state(generation_prompt, with_prompt))

    @staticmethod
    def _continued(rendered: str, messages: list[dict]) -> str:
        """The rendering cut where the final assistant message's content ends."""
        last = messages[-1] if messages else {}
        content = last.get("content")
        if last.get("role") != "assistant" or not isinstance(content, str) or not content.strip():
            raise ValueError("continue_final_message needs a final assistant message with text content")
        at = rendered.rfind(content.strip())
        if at < 0:
            raise TemplateError("the chat template does not show the final assistant message's "
                                "content; cannot continue it")
        return rendered[:at + len(content.strip())]

    def remember(self, prompt_ids: list[int], completion_ids: list[int]) -> None:
        """Record an answer's tokens and the prompt's they follow, for when
        it comes back in a later prompt."""
        self.memo.remember(prompt_ids, completion_ids, self.special, self.tokenizer)

    def _reasoning_state(self, generation_prompt: str, prompt: str = "") -> str | None:
        """Whether the prompt opened a reasoning block ("open"), holds a
        whole one or opened the answer with none ("closed") or neither
        (None): read from the generation prompt, or from the prompt's end
        where a template writes the block's start whatever
        add_generation_prompt says (Apriel 1.6)."""
        if self.reasoning is None:
            return None
        start, end = self._marker_texts()
        i = generation_prompt.rfind(start)
        if i < 0 and start and prompt.endswith(start + self.reasoning.open):
            return "open"
        answer = self.markers.text("answer", self.special)
        if i < 0:   # no block, unless the prompt opened the answer past it (Kimi K3 with thinking off)
            return "closed" if answer and generation_prompt.endswith(answer) else None
        return "closed" if end in generation_prompt[i:] else "open"

    # -- probes --------------------------------------------------------

    def _render_probe(self, messages: list[dict], tools: list[dict]) -> str:
        return self.render(normalize_messages(messages, self.tools_or_none(), self.contract), tools=tools,
                           add_generation_prompt=False)

    def _probe_contract(self) -> TemplateContract:
        def shows(messages, text: str, add_generation_prompt: bool = True) -> bool:
            try:
                return text in render_chat(self.template, messages, add_generation_prompt=add_generation_prompt,
                                           **self._tokens)
            except TemplateError:
                return False
        user = {"role": "user", "content": "Hi there"}
        typed = not shows([user], "Hi there") and \
            shows([{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}], "Hi there")
        contract = TemplateContract(typed_content=typed)
        system = normalize_messages([{"role": "system", "content": "Be brief."}, user], None, contract)
        takes_system = shows(system, "Be brief.") or not shows(system[1:], "Hi there")
        return replace(contract, system=takes_system, reasoning_key=next(
            (key for key in ("reasoning_content", "thinking") if shows(normalize_messages(
                [user, {"role": "assistant", "content": _PROBE_ANSWER, key: _PROBE_REASONING}], None,
                contract), _PROBE_REASONING, False)), "reasoning_content"))

    def _thinking_switch(self) -> str | None:
        """The template variable that turns thinking on and off:
        ``enable_thinking`` where the template names it, else ``thinking``
        where it changes the generation prompt (Kimi K3's)."""
        if "enable_thinking" in self.template:
            return "enable_thinking"
        prompts = set()
        for on in (True, False):
            try:
                prompts.add(render_chat(self.template, [{"role": "user", "content": "Hi"}], thinking=on,
                                        add_generation_prompt=True, **self._tokens))
            except TemplateError:
                return None
        return "thinking" if len(prompts) == 2 else None

    def tools_or_none(self) -> DetectedFormat | None:
        return getattr(self, "tools", None)

    def _before_calls(self) -> str:
        """What the template writes between an answer and the calls after it,
        where the calls follow the answer's frame (Kimi K3's response tag
        closed); "" elsewhere."""
        m = self.markers
        return m.text("answer_end", self.special) if m is not None and m.calls_after_answer else ""

    def _turn_end_ids(self, special: SpecialTokens) -> set[int]:
        """The added token right after an assistant answer ends that turn: an
        end token whatever the metadata says (rule 1)."""
        try:
            text = render_chat(self.template, [{"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": _PROBE_ANSWER}],
                               add_generation_prompt=False, **self._tokens)
        except TemplateError:
            return set()
        after = text[text.find(_PROBE_ANSWER) + len(_PROBE_ANSWER):] if _PROBE_ANSWER in text else ""
        for tid, t in sorted(special.texts.items(), key=lambda kv: -len(kv[1])):
            if after.startswith(t):
                return {tid}
        return set()

    def _marker_texts(self) -> tuple[str, str]:
        return self.markers.text("start", self.special), self.markers.text("end", self.special)

    def _reasoning_layout(self) -> ReasoningLayout:
        return replace(self._block_layout(), empty=self._empty_block())

    def _empty_block(self) -> tuple[str, str] | None:
        """The whitespace of the empty reasoning block the template writes in
        a past answer that had none, if it writes one."""
        start, end = self._marker_texts()
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE_ANSWER},
                    {"role": "user", "content": "Again"}]
        try:
            text = self.render(messages, add_generation_prompt=False)
        except TemplateError:
            return None
        m = text.find(self.markers.text("answer", self.special) + _PROBE_ANSWER)   # (after its opening: Kimi K3's)
        i = text.rfind(start, text.find("Hi"), max(m, 0))
        k = text.find(end, i) if i >= 0 else -1
        if m < 0 or i < 0 or not 0 <= k < m:
            return None
        inside, after = text[i + len(start):k], text[k + len(end):m]
        return None if inside.strip() or after.strip() else (inside, after)

    def _block_layout(self) -> ReasoningLayout:
        """The whitespace around a past answer's reasoning; where the
        template shows reasoning on call turns only (Command R7B), around a
        past call's."""
        start, end = self._marker_texts()
        reasoning = {self.contract.reasoning_key: _PROBE_REASONING}
        messages = [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": _PROBE_ANSWER, **reasoning}]
        try:
            text = self.render(messages, add_generation_prompt=False)
        except TemplateError:
            return ReasoningLayout()
        # a start marker of text alone may be the generation prompt's, never rendered (Apriel 1.6's)
        prompted = text_only(self.markers.start) is not None
        pieces = _pieces(text, start, end, self.markers.text("answer", self.special) + _PROBE_ANSWER, prompted)
        if pieces is None:
            call = probe_calls(self.tools.format)[:1]
            try:
                called = self._render_probe([messages[0], {"role": "assistant", "content": self.tools.empty_content,
                                                           "tool_calls": openai_calls(call), **reasoning}],
                                            PROBE_TOOLS)
            except TemplateError:
                called = ""
            pieces = _pieces(called, start, end, self.tools.format.render(call, self.special), prompted)
        if pieces is None:
            return self._empty_block_layout(text, start, end)
        if any(p.strip() for p in pieces):
            return ReasoningLayout()
        return ReasoningLayout(*pieces, kept=True)

    @staticmethod
    def _empty_block_layout(text: str, start: str, end: str) -> ReasoningLayout:
        """Where the template drops the probe's reasoning but writes an empty
        block before the answer (Kimi K2's `<think></think>`), its whitespace."""
        i = text.rfind(start, 0, max(text.find(_PROBE_ANSWER), 0))
        k = text.find(end, i) if i >= 0 else -1
        m = text.find(_PROBE_ANSWER, k) if k >= 0 else -1
        if m < 0 or text[i + len(start):k].strip() or text[k + len(end):m].strip():
            return ReasoningLayout()
        inner = text[i + len(start):k]
        half = len(inner) // 2
        return ReasoningLayout(inner[:half], inner[half:], text[k + len(end):m])


def _pieces(text: str, start: str, end: str, follows: str,
            prompted: bool = False) -> tuple[str, str, str] | None:
    """(after the start marker, before the end marker, between it and what
    ``follows``) around the probe's reasoning in ``text``; None where the
    reasoning is not shown so. ``prompted``: the start marker may be absent
    (only a generation prompt writes it)."""
    j = text.find(_PROBE_REASONING)
    i = text.rfind(start, 0, max(j, 0))   # (a preamble may name the marker: Command R7B's)
    if i < 0 and prompted and j >= 0:
        i, start = j, ""
    k = text.find(end, max(j, 0))
    m = text.find(follows, max(k, 0))
    if min(i, j, k, m) < 0 or not i <= j < k < m:
        return None
    return text[i + len(start):j], text[j + len(_PROBE_REASONING):k], text[k + len(end):m]


# -- client messages → what templates expect ---------------------------


def normalize_messages(messages: list[dict], fmt: DetectedFormat | None,
                       contract: TemplateContract | None = None) -> list[dict]:
    """OpenAI-shaped messages as chat templates expect them: content parts
    joined, tool-call arguments as dicts (templates apply tojson), a call-only
    message's content as the template wants it, and, for the text envelope,
    past calls written into the content as the model wrote them. A tool
    result without a ``name`` gets its call's (Kimi and GLM templates print it).
    Per the template's ``contract``: system messages open the first user
    message where it takes none, and content becomes a list of text parts
    where it wants one."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    call_names: dict[str, str] = {}
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        m = copy.deepcopy(message)
        m["content"] = _content_text(m.get("content"), f"messages[{i}].content")
        if contract is not None and contract.reasoning_key != "reasoning_content" and "reasoning_content" in m:
            m.setdefault(contract.reasoning_key, m.pop("reasoning_content"))
        calls = m.get("tool_calls")
        if calls:
            m["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]")
                               for j, c in enumerate(calls)]
            call_names.update((c["id"], c["function"]["name"]) for c in m["tool_calls"]
                              if isinstance(c.get("id"), str))
            if fmt is not None and not fmt.native:
                m = _envelope_message(m, fmt)
            elif not m["content"] and fmt is not None:
                m["content"] = fmt.empty_content
        elif m["content"] is None:
            m["content"] = ""
        if m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in call_names:
            m["name"] = call_names[m["tool_call_id"]]
        out.append(m)
    return _to_contract(out, contract) if contract is not None else out


def _to_contract(messages: list[dict], contract: TemplateContract) -> list[dict]:
    if not contract.system and any(m["role"] == "system" for m in messages):
        system = "\n\n".join(m["content"] or "" for m in messages if m["role"] == "system")
        messages = [m for m in messages if m["role"] != "system"]
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first is None:
            messages.insert(0, {"role": "user", "content": system})
        else:
            messages[first] = {**messages[first], "content": system + "\n\n" + (messages[first]["content"] or "")}
    if contract.typed_content:
        messages = [{**m, "content": [{"type": "text", "text": m["content"]}]}
                    if isinstance(m.get("content"), str) else m for m in messages]
    return messages


def _content_text(content, where: str):
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise ValueError(f"{where}: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"{where} must be a string, a list of text parts, or null")


def _template_call(call, where: str) -> dict:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ValueError(f"{where} must be an object with a 'function'")
    fn = dict(call["function"])
    if not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}.function.name must be a string")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {exc}") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object")
    fn["arguments"] = TemplateArguments(args)
    return {**call, "type": call.get("type", "function"), "function": fn}


class TemplateArguments(dict):
    """Tool-call arguments as templates use them: most apply ``tojson`` or
    iterate items (a dict), some concatenate them to a string (the JSON
    text). Being both, one conversation renders under either kind. Objects
    and lists inside print as JSON too (``|string``: Seed-OSS, LFM2.5 and
    Llama 4's pythonic template print a value so), as the grammar has the
    model write them, not as Python's repr."""

    def __init__(self, arguments: dict):
        super().__init__((k, _printed_as_json(v)) for k, v in arguments.items())

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __radd__(self, other):
        if isinstance(other, str):
            return other + str(self)
        return NotImplemented

    def __add__(self, other):
        if isinstance(other, str):
            return str(self) + other
        return NotImplemented


class _TemplateList(list):
    """A list inside tool-call arguments: printed as JSON (TemplateArguments)."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)


def _printed_as_json(value):
    if isinstance(value, dict):
        return TemplateArguments(value)
    if isinstance(value, list):
        return _TemplateList(_printed_as_json(v) for v in value)
    return value


def _envelope_message(m: dict, fmt: DetectedFormat) -> dict:
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"],
              "id": c.get("id", "")} for c in m.pop("tool_calls")]
    text = TEXT_ENVELOPE.render(calls, None)
    m["content"] = (m["content"] + fmt.content_sep + text) if m["content"] else text
    return m
