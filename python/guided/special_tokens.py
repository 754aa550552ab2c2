"""The special-token registry: the one place that knows what each added token
of a model is for (DESIGN.md rules 1, 2 and 7).

Sources, in order: the tokenizer's added tokens; the ids the model files
declare (tokenizer_config.json, generation_config.json, config.json, GGUF
metadata); the chat template (the token that ends an assistant turn in a
render is an end token whatever the metadata says); and, where the files are
silent, the marker roles below. The tool-call format table
(chat/tool_formats.py) asks for its other markers by their text: ``id(role)``
answers a role, else the added token of that exact text. Every other module
asks the registry (``registry.id("tool_call_start")``, ``registry.end_ids``)
and never matches token text itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from tokenizers import Tokenizer

# Added tokens that end generation in the families we know, whether or not
# the model's metadata lists them (rule 1: end of sequence is a set). Not
# "</s>": where it ends a turn (Llama 2, Mistral) the model declares it, and
# in Gemma's vocabulary it is an HTML tag the model writes (llama.cpp's list
# leaves it out too).
KNOWN_END_TEXTS = frozenset({
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>",
    "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<｜end▁of▁sentence｜>",
    "<|end_of_msg|>",   # Kimi K3's: its template writes it after <|close|>message<|sep|>, not right after the answer
})

# Added tokens that end one message or tag, not the turn, in a vocabulary
# that also has the token named beside them: harmony (gpt-oss) ends its
# analysis message with <|end|> and goes on in the same turn; <|return|> and
# <|call|> end the turn. Kimi K3 closes each tag (its answer's, its
# message's) with <|close|>; <|end_of_msg|> ends the turn. Such a token is no
# end token, declared or found after an answer in the template (llama.cpp
# drops <|end|> from its end-of-generation set alike).
MESSAGE_END_TEXTS: Mapping[str, str] = MappingProxyType({"<|end|>": "<|return|>", "<|close|>": "<|end_of_msg|>"})

# End tokens a grammar writes itself where a call or an answer ends (harmony's
# <|call|>, GigaChat's <|message_sep|>, which a call turn may follow); no
# grammar allows them as its end (SpecialTokens.grammar_end_ids), and under
# a grammar one ends the output only where the grammar may end
# (rust/engine/sequence.rs: append_under).
WRITTEN_END_TEXTS = frozenset({"<|call|>", "<|message_sep|>"})

# Markers other modules ask for by a role: text → role. The tool-call format
# table's other markers are asked for by their text (SpecialTokens.id).
MARKER_ROLES: Mapping[str, str] = MappingProxyType({
    # Hermes / Qwen tool calls (chat/tool_formats.py's TOOL_CALL_START and TOOL_CALL_END)
    "<tool_call>": "tool_call_start", "</tool_call>": "tool_call_end",
    # reasoning
    "<think>": "reasoning_start", "</think>": "reasoning_end",
    "[THINK]": "reasoning_start", "[/THINK]": "reasoning_end",
    "<seed:think>": "reasoning_start", "</seed:think>": "reasoning_end",
    # Hermes / Qwen tool results
    "<tool_response>": "tool_response_start", "</tool_response>": "tool_response_end",
    # Llama 3.x
    "<|python_tag|>": "python_tag",
    "<|start_header_id|>": "header_start", "<|end_header_id|>": "header_end",
    # Mistral
    "[CALL_ID]": "tool_call_id_marker",
    "[AVAILABLE_TOOLS]": "tools_start", "[/AVAILABLE_TOOLS]": "tools_end",
    "[TOOL_RESULTS]": "tool_results_start", "[/TOOL_RESULTS]": "tool_results_end",
    "[INST]": "user_start", "[/INST]": "user_end",
    "[SYSTEM_PROMPT]": "system_start", "[/SYSTEM_PROMPT]": "system_end",
    # DeepSeek R1 / V3
    "<｜tool▁outputs▁begin｜>": "tool_outputs_begin", "<｜tool▁outputs▁end｜>": "tool_outputs_end",
    "<｜tool▁output▁begin｜>": "tool_output_begin", "<｜tool▁output▁end｜>": "tool_output_end",
    "<｜User｜>": "user_start", "<｜Assistant｜>": "assistant_start",
    # ChatML
    "<|im_start|>": "turn_start",
})


@dataclass(frozen=True)
class SpecialTokens:
    """Added tokens of one model, classified once at load time.

    ``control_ids`` holds every added token: text a client sends is never
    tokenized into any of them (rule 7), and no text is shown for them.
    """

    end_ids: frozenset[int]
    control_ids: frozenset[int]
    texts: Mapping[int, str]                  # id → text, for every added token
    roles: Mapping[str, int] = field(default_factory=dict)   # role → id: MARKER_ROLES
    bos_id: int | None = None
    pad_id: int | None = None
    #: text → id of every added token (the lowest id where two share a text)
    by_text: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def classify(cls, tokenizer: Tokenizer, declared_end_ids: set[int],
                 bos_token: str | None = None, pad_token: str | None = None) -> "SpecialTokens":
        decoder = tokenizer.get_added_tokens_decoder()
        texts = {tid: tok.content for tid, tok in decoder.items()}
        ids = {text: tid for tid, text in sorted(texts.items(), reverse=True)}
        ends = set(declared_end_ids) | {ids[t] for t in KNOWN_END_TEXTS if t in ids}
        ends -= _message_ends(ids)
        if not ends:
            raise ValueError("the model declares no end token; generation could never stop")
        roles: dict[str, int] = {}
        for text, role in MARKER_ROLES.items():
            if text in ids:
                roles.setdefault(role, ids[text])
        return cls(end_ids=frozenset(ends), control_ids=frozenset(texts),
                   texts=MappingProxyType(texts), roles=MappingProxyType(roles),
                   bos_id=ids.get(bos_token) if bos_token else None,
                   pad_id=ids.get(pad_token) if pad_token else None, by_text=MappingProxyType(ids))

    def with_end_ids(self, extra: set[int]) -> "SpecialTokens":
        """The registry with more end tokens (found in the chat template),
        none that ends only a message (MESSAGE_END_TEXTS)."""
        extra = frozenset(extra) - _message_ends(self.by_text)
        return SpecialTokens(self.end_ids | extra, self.control_ids, self.texts,
                             self.roles, self.bos_id, self.pad_id, self.by_text)

    # -- questions the other layers ask --------------------------------

    def id(self, role: str) -> int | None:
        """The token of a role (MARKER_ROLES), else the added token spelled ``role``."""
        found = self.roles.get(role)
        return found if found is not None else self.by_text.get(role)

    def text(self, token_id: int) -> str:
        return self.texts[token_id]

    def id_of_text(self, text: str) -> int | None:
        """The added token whose text is exactly ``text``, if any."""
        return self.by_text.get(text)

    @property
    def grammar_end_ids(self) -> frozenset[int]:
        """The end tokens a grammar allows wherever it may end: all but
        those the grammar writes itself (WRITTEN_END_TEXTS)."""
        written = {self.by_text[t] for t in WRITTEN_END_TEXTS if t in self.by_text}
        return self.end_ids - written or self.end_ids

    @property
    def reasoning_ids(self) -> tuple[int, int] | None:
        return self._pair("reasoning_start", "reasoning_end")

    def marker_texts(self) -> list[str]:
        """Every marker text this model has (the injection test's alphabet)."""
        return sorted(set(self.texts.values()))

    def _pair(self, a: str, b: str) -> tuple[int, int] | None:
        if a in self.roles and b in self.roles:
            return self.roles[a], self.roles[b]
        return None


def _message_ends(ids: Mapping[str, int]) -> set[int]:
    """The tokens of ``ids`` (text → id) that end a message, not the turn:
    MESSAGE_END_TEXTS whose turn's end is in the vocabulary too."""
    return {ids[t] for t, turn_end in MESSAGE_END_TEXTS.items() if t in ids and turn_end in ids}
