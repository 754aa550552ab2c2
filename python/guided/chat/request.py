"""One chat request, checked and planned: the prompt ids, the grammar of the
whole assistant message, and a parser for what comes back.

Every field is checked here, where it enters, with a ValueError that names
it; nothing reaches the engine until the whole request is known to be good.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..grammar import ComposedGrammar, check_on_length, constraint_entry, on_length
from .grammar import ReasoningPlan, Tool, ToolPlan, compose_chat, tool_args_entry
from ..grammar.json_schema import json_schema_grammar
from ..grammar.json_schema.strict import strict_schema
from ..sampling_params import SamplingParams
from .chat_format import ChatFormat, EncodedChat, normalize_messages
from .parser import ChatParser
from .message_formats import marker_ids, unwritten
from .tool_formats import TEXT_ENVELOPE, resolve

#: Reasoning token budgets per effort (tokens of reasoning text, enforced by
#: the grammar). None: the model's default; "none": no reasoning block.
REASONING_BUDGETS = {"minimal": 128, "low": 512, "medium": 2048, "high": 8192}
REASONING_EFFORTS = ("none", *REASONING_BUDGETS)

_TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


@dataclass(frozen=True)
class ChatOptions:
    """What a chat request asks for beyond its messages and sampling, as
    every API passes it to :func:`prepare_chat` (which checks each field).

    tool_choice: "auto", "none", "required", {"type": "function",
    "function": {"name": ...}} or {"type": "allowed_tools", "allowed_tools":
    {"mode": "auto"|"required", "tools": [{"type": "function", "function":
    {"name": ...}}]}} (the grammar limited to those tools, the prompt
    unchanged); reasoning_effort: "none", "minimal", "low",
    "medium", "high" or None (the model's default); reasoning_budget: tokens
    of reasoning text at most, the block required (Anthropic's thinking
    budget_tokens; with an effort, the smaller budget); response_format or
    structured_outputs (one of them) constrain the answer; tool_grammar:
    enforce the tool-call grammar for tool_choice "auto" too;
    add_generation_prompt and continue_final_message as in vLLM and
    transformers (the prompt ends with a new assistant turn, after the last
    message, or inside the final assistant message, which the model
    continues)."""

    tools: list[dict] | None = None
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    response_format: dict | None = None
    structured_outputs: dict | None = None
    reasoning_effort: str | None = None
    reasoning_budget: int | None = None
    chat_template_kwargs: dict | None = None
    documents: list | None = None
    tool_grammar: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False


@dataclass
class ChatPlan:
    prompt_ids: list[int]
    params: SamplingParams
    grammar: ComposedGrammar | None  # the whole message's grammar, or None (free text)
    encoded: EncodedChat
    make_parser: Callable[[], ChatParser]

    def parser(self) -> ChatParser:
        return self.make_parser()


def prepare_chat(chat: ChatFormat, compile_check: Callable[[str], Any], messages: list[dict],
                 options: ChatOptions, sampling_params: SamplingParams | None = None) -> ChatPlan:
    """``compile_check(grammar_json)`` raises ValueError when a grammar does
    not compile (the engine's compiler; its cache makes the later compile free)."""
    o = _with_params_constraint(options, sampling_params)
    parsed_tools = _check_tools(o.tools, compile_check)
    choice = _check_tool_choice(o.tool_choice, parsed_tools)
    answer = _check_response_format(o.response_format)
    if o.structured_outputs is not None:
        if answer is not None:
            raise ValueError("give either response_format or structured_outputs, not both")
        answer = _constraint(o.structured_outputs)
    effort = _check_effort(o.reasoning_effort, chat)
    budget = _check_budget(o.reasoning_budget, effort, chat)
    if not isinstance(o.parallel_tool_calls, bool):
        raise ValueError("parallel_tool_calls must be a boolean")
    kwargs = _template_kwargs(chat, o.chat_template_kwargs, effort)
    if budget is not None and chat.thinking_switch:
        kwargs.setdefault(chat.thinking_switch, True)

    fmt = chat.tools
    msgs = normalize_messages(messages, fmt, chat.contract)
    template_tools = [t["raw"] for t in parsed_tools] or None
    if parsed_tools and not fmt.native and "tools" not in chat.template:
        msgs = _with_envelope_system(msgs, parsed_tools)
        template_tools = None
    encoded = chat.encode(msgs, tools=template_tools, documents=o.documents, kwargs=kwargs,
                          prompt=_prompt_mode(o))

    reasoning = _reasoning_plan(chat, encoded, effort, budget)
    # the template's whitespace before calls, where no reasoning block (whose
    # layout says what follows it) can come first
    no_block = reasoning is None or reasoning.state == "closed" or (
        reasoning.mode == "forbidden" and reasoning.state is None and reasoning.empty is None)
    tool_plan = _tool_plan(fmt, parsed_tools, choice, o.parallel_tool_calls, o.tool_grammar,
                           _call_lead(fmt.call_ws, encoded.generation_prompt) if no_block else "")
    if answer is not None:
        where = "response_format" if o.structured_outputs is None else "structured_outputs"
        try:
            compile_check(json.dumps({"grammars": [answer]}))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    params = replace(sampling_params or SamplingParams(max_tokens=256), structured_outputs=None)
    grammar = None
    # an answer framed by markers the model writes (harmony's channels, Kimi K3's tags) always has its grammar
    frame = unwritten(chat.markers, encoded.generation_prompt, chat.special)
    if tool_plan is not None or answer is not None or (reasoning and reasoning.mode != "optional") or \
            (frame is not None and (frame.answer or frame.message_end)):
        if reasoning is not None and reasoning.mode != "forbidden" and reasoning.state != "closed":
            body = compose_chat(chat.special, tools=tool_plan, answer=answer, frame=frame)
            reasoning = replace(reasoning, budget=reasoning_bound(
                reasoning.budget, params.max_tokens, _shortest(compile_check(body), params.max_tokens)))
        text = compose_chat(chat.special, reasoning=reasoning, tools=tool_plan, answer=answer, frame=frame)
        compiled = compile_check(text)
        answer_options = o.structured_outputs if o.structured_outputs is not None else o.response_format
        length = on_length(answer_options)
        if not _asks_structure(tool_plan, answer) and compiled.matcher().shortest_completion(params.max_tokens) is None:
            # only the template's markup to close (a reasoning block the prompt opened, an answer's
            # frame), and no room for it: cut at max_tokens as text without a grammar is, not refused
            length = "cut"
            params = replace(params, on_length="cut") if params.on_length else params
        grammar = ComposedGrammar(text, length, _reasoning_end(chat, reasoning))

    callable_ = _callable(choice, parsed_tools)
    schemas = {t["name"]: t["schema"] for t in parsed_tools if t["name"] in callable_}
    layout = (chat.reasoning.open, chat.reasoning.close, chat.reasoning.after) if chat.reasoning else None
    return ChatPlan(encoded.ids, params, grammar, encoded,
                    lambda: ChatParser(chat.special, chat.tokenizer, fmt, schemas, layout,
                                       encoded.reasoning_state, stop=params.stop, markers=chat.markers,
                                       on_finish=lambda ids: chat.remember(encoded.ids, ids)))


# -- checks ------------------------------------------------------------


def _prompt_mode(options: ChatOptions) -> str:
    """How the prompt ends (ChatFormat.encode's ``prompt``)."""
    for name in ("add_generation_prompt", "continue_final_message"):
        if not isinstance(getattr(options, name), bool):
            raise ValueError(f"{name} must be a boolean")
    if options.continue_final_message:
        if options.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: "
                             "set add_generation_prompt=False to continue the final message")
        return "continue"
    return "generate" if options.add_generation_prompt else "none"


def _with_params_constraint(options: ChatOptions, params: SamplingParams | None) -> ChatOptions:
    """A constraint in the sampling params (vLLM's way) is the same as the
    structured_outputs option: honoured, never dropped."""
    given = getattr(params, "structured_outputs", None)
    if given is None:
        return options
    if options.structured_outputs is not None and options.structured_outputs != given:
        raise ValueError("structured_outputs is given twice, in sampling_params and as an option, "
                         "and they differ: give one")
    return replace(options, structured_outputs=given)


def _check_tools(tools, compile_check) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(tool.get("function"), dict):
            raise ValueError(f"{where} must be {{'type': 'function', 'function': {{...}}}}")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'")
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is given twice")
        seen.add(name)
        schema = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise ValueError(f"{where}.function.parameters must be a JSON Schema of type 'object'")
        # Arguments carry the parameters the tool declares, as a function
        # takes them (llama.cpp, xgrammar's strict mode, OpenAI's strict):
        # an object that does not say additionalProperties takes no other
        # property, unless the tool says "strict": false (JSON Schema's
        # open default).
        if _strict(fn.get("strict"), f"{where}.function.strict") or fn.get("strict") is None:
            schema = strict_schema(schema)
        entry = schema_entry(tool_args_entry, schema, f"{where}.function.parameters")
        schema_entry(lambda e: compile_check(json.dumps({"grammars": [e]})), entry,
                     f"{where}.function.parameters")
        # the template sees the tool without ``strict``: a switch of this
        # server's grammar, not part of the tool (so a tool renders the same
        # whichever API brought it, with or without the flag)
        shown = {k: v for k, v in fn.items() if k != "strict"}
        out.append({"name": name, "schema": schema, "raw": {"type": "function", "function": shown}})
    return out


def _check_tool_choice(choice, tools: list[dict]):
    """"auto", "none", "required", {"name": NAME} (one tool, required) or
    {"allowed": (NAME, ...), "mode": "auto"|"required"} (OpenAI's
    allowed_tools: the grammar limited to a subset, the prompt unchanged)."""
    if choice in (None, "auto"):
        return "auto" if tools else "none"
    if choice in ("none", "required"):
        if choice == "required" and not tools:
            raise ValueError("tool_choice is 'required' but no tools are given")
        return choice
    declared = {t["name"] for t in tools}
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in declared:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
        return {"name": name}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return _check_allowed_tools(choice.get("allowed_tools"), declared)
    raise ValueError("tool_choice must be 'none', 'auto', 'required', "
                     "{'type': 'function', 'function': {'name': ...}} or "
                     "{'type': 'allowed_tools', 'allowed_tools': {'mode': ..., 'tools': [...]}}")


def _check_allowed_tools(allowed, declared: set[str]) -> dict:
    where = "tool_choice.allowed_tools"
    if not isinstance(allowed, dict):
        raise ValueError(f"{where} must be an object with 'mode' and 'tools'")
    mode = allowed.get("mode")
    if mode not in ("auto", "required"):
        raise ValueError(f"{where}.mode must be 'auto' or 'required', got {mode!r}")
    listed = allowed.get("tools")
    if not isinstance(listed, list) or not listed:
        raise ValueError(f"{where}.tools must be a non-empty list of "
                         "{'type': 'function', 'function': {'name': ...}}")
    names = []
    for i, tool in enumerate(listed):
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ValueError(f"{where}.tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        if name not in declared:
            raise ValueError(f"{where}.tools[{i}] names the function {name!r}, which is not in tools")
        names.append(name)
    return {"allowed": tuple(dict.fromkeys(names)), "mode": mode}


def _check_response_format(rf) -> dict | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise ValueError("response_format.type must be 'text', 'json_object' or 'json_schema'")
    check_on_length(rf.get("on_length"), "response_format.on_length")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return json_schema_grammar({"type": "object"})
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
        raise ValueError("response_format.json_schema must be an object with a 'schema'")
    schema = spec.get("schema", {})
    if _strict(spec.get("strict"), "response_format.json_schema.strict"):
        schema = strict_schema(schema)
    return schema_entry(json_schema_grammar, schema, "response_format.json_schema.schema")


def _strict(value, where: str) -> bool:
    """OpenAI's ``strict`` flag (see grammar/json_schema/strict.py)."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{where} must be a boolean")
    return bool(value)


#: Tokens a bounded reasoning block leaves for the answer beyond its
#: shortest form (at most; half of what is left where that is less), and
#: for the block's own markup (its start and end tokens, the text after).
ANSWER_ROOM, MARKUP = 256, 8


def reasoning_bound(effort_budget: int | None, max_tokens: int, shortest_answer: int) -> int:
    """Tokens of reasoning text allowed when the answer must still fit:
    the smaller of the effort's budget and what max_tokens leaves after
    the shortest answer the grammar allows, its markup and some room for
    the model to write the answer itself (the closing at the budget
    completes it where the model runs long)."""
    left = max(0, max_tokens - shortest_answer - MARKUP)
    bound = max(1, left - min(ANSWER_ROOM, left // 2))
    return bound if effort_budget is None else min(effort_budget, bound)


def _reasoning_end(chat: ChatFormat, r: ReasoningPlan | None) -> tuple[int, int] | None:
    """The first token of the reasoning block's end marker and the output
    length by which the engine writes it (fast-forward writes the rest of
    the marker): its budget of text, plus the start marker and the opening
    text where the model opens the block itself."""
    if r is None or r.budget is None or r.mode == "forbidden" or r.state == "closed":
        return None
    end = resolve(r.end[0], chat.special)[0]
    if end is None:
        return None   # an end marker of text: the closing at max_tokens still applies
    start = 0 if r.state == "open" else \
        len(marker_ids(r.start, chat.special, chat.tokenizer)) + len(chat.tokenizer.encode_text(r.open))
    return end, r.budget + start


def _asks_structure(tools: ToolPlan | None, answer: dict | None) -> bool:
    """Whether a request asks for output that must be whole (a client
    constraint, calls required or named): refused where its shortest cannot
    fit max_tokens. Text, tool_choice auto or none and reasoning never are."""
    return answer is not None or (tools is not None and tools.mode == "required")


def _shortest(grammar, max_tokens: int) -> int:
    """Tokens of the shortest complete output of a compiled grammar (from its
    start); 0 where the search finds none within max_tokens (the bound is
    then the room left, and the closing at the budget still applies)."""
    found = grammar.matcher().shortest_completion(max_tokens)
    return 0 if found is None else len(found)


def _constraint(so) -> dict:
    try:
        return constraint_entry(so)
    except ValueError as exc:
        raise ValueError(f"structured_outputs: {exc}") from None


def schema_entry(build: Callable[[Any], dict], schema: Any, where: str) -> dict:
    """``build(schema)``, with any failure a ValueError naming ``where``: a
    malformed schema (``"minimum": "x"``) must fail its request, not the caller."""
    try:
        return build(schema)
    except Exception as exc:  # noqa: BLE001 - the sanitiser walks untrusted input
        raise ValueError(f"{where} is not a usable JSON Schema: {exc}") from None


def _check_effort(effort, chat: ChatFormat) -> str | None:
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, "
                         f"got {effort!r}")
    if effort != "none" and chat.reasoning is None:
        raise ValueError(f"reasoning_effort={effort!r}: this model's template and tokenizer "
                         "have no reasoning block")
    return effort


def _check_budget(budget, effort: str | None, chat: ChatFormat) -> int | None:
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"reasoning_budget must be a positive integer, got {budget!r}")
    if chat.reasoning is None:
        raise ValueError("reasoning_budget: this model's template and tokenizer have no reasoning block")
    if effort == "none":
        raise ValueError("reasoning_budget with reasoning_effort='none': give one")
    return budget


def _template_kwargs(chat: ChatFormat, given: dict | None, effort: str | None) -> dict:
    if given is not None and not isinstance(given, dict):
        raise ValueError("chat_template_kwargs must be an object")
    kwargs = dict(given or {})
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
        if chat.thinking_switch:
            kwargs.setdefault(chat.thinking_switch, effort != "none")
    return kwargs


# -- plans ---------------------------------------------------------------


def _tool_plan(fmt, tools, choice, parallel: bool, tool_grammar: bool, lead: str) -> ToolPlan | None:
    """The calls the grammar allows. "none" with tools is a plan too: its
    grammar has no call in it (the call markers banned)."""
    if not tools:
        return None
    if choice == "none":
        return ToolPlan(fmt, (), "none", parallel=False)
    mode = choice["mode"] if isinstance(choice, dict) and "mode" in choice else \
        "required" if isinstance(choice, dict) else choice
    if mode == "auto" and not tool_grammar:
        return None
    names = _callable(choice, tools)
    chosen = tuple(Tool(t["name"], t["schema"]) for t in tools if t["name"] in names)
    one = isinstance(choice, dict) and "name" in choice   # a named tool: one call of it
    return ToolPlan(fmt, chosen, mode, parallel=parallel and fmt.parallel and not one, lead=lead)


def _callable(choice, tools: list[dict]) -> set[str]:
    """The names of the tools a request lets the model call."""
    if isinstance(choice, dict):
        return {choice["name"]} if "name" in choice else set(choice["allowed"])
    return set() if choice == "none" else {t["name"] for t in tools}


def _call_lead(call_ws: str, generation_prompt: str) -> str:
    """What the model writes before the calls of a call-only answer: the
    template's whitespace there, less what the generation prompt already ends with."""
    tail = generation_prompt[len(generation_prompt.rstrip()):]
    return call_ws[len(tail):] if call_ws.startswith(tail) else call_ws


def _reasoning_plan(chat: ChatFormat, encoded: EncodedChat, effort: str | None,
                    budget: int | None) -> ReasoningPlan | None:
    if chat.reasoning is None:
        return None
    layout = chat.reasoning
    mode = "optional" if effort is None and budget is None else \
        "forbidden" if effort == "none" else "required"
    budgets = [b for b in (REASONING_BUDGETS.get(effort), budget) if b is not None]
    return ReasoningPlan(chat.markers.start, chat.markers.end, layout.open, layout.close, layout.after,
                         encoded.reasoning_state, mode, min(budgets, default=None), empty=layout.empty)


def _with_envelope_system(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Tools for a template that cannot show them: described in the system
    message, with the envelope the grammar and parser use."""
    listing = "\n".join(json.dumps(t["raw"]["function"], ensure_ascii=False) for t in tools)
    example = TEXT_ENVELOPE.render([{"name": "<function-name>", "arguments": {"<arg>": "<value>"},
                                     "id": ""}], None)
    note = ("You can call these functions:\n" + listing + "\n\nTo call one, reply with:\n" + example)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{note}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]
