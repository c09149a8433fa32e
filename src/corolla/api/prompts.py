"""Prompts as token ids: chat messages through the tokenizer's chat template (or the plain fallback), text prompts
through the tokenizer.

Chat with a template: `apply_chat_template(messages, add_generation_prompt=True)` renders the text, which is then
tokenized without adding special tokens again (the template writes them), as vLLM does.

Chat without a template (a base model): the plain fallback writes one line per message and leaves the assistant's
turn open, tokenized with the tokenizer's special tokens (e.g. BOS):

    System: You are terse.
    User: Hi!
    Assistant: Hello.
    User: How are you?
    Assistant:

and generation also stops at "\\nUser:" (a base model would otherwise write the user's next turn itself).
Roles are written System (system, developer), User, Assistant and Tool.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Sequence

FALLBACK_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
FALLBACK_STOPS: tuple[str, ...] = ("\nUser:",)


class PromptError(ValueError):
    """A prompt the tokenizer or chat template cannot render; `param` names the request field."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def fallback_text(messages: Sequence[dict[str, str]]) -> str:
    """The plain chat prompt of the module docstring. A content's own leading space is the one after the colon
    (a reply generated after "Assistant:" starts with one), so a reply sent back re-tokenizes as generated."""
    lines = []
    for m in messages:
        content = m["content"][1:] if m["content"].startswith(" ") else m["content"]
        lines.append(f"{FALLBACK_ROLES.get(m['role'], m['role'].capitalize())}: {content}")
    return "\n".join([*lines, "Assistant:"])


class PromptBuilder:
    """Token ids of chat and completion prompts for one tokenizer. Thread-safe: its uses of the tokenizer are
    serialized by its own lock, so the tokenizer must be its own (a copy of the engine's): a long prompt being
    encoded then never holds up the engine's decoding of every stream's tokens. Decoding (echo, log-probability
    tokens, on the HTTP event loop) uses a second copy under a second lock, so it never waits for an encoding.

    `max_tokens` (the context length) bounds the text it renders and encodes: a text longer than `max_tokens`
    tokens of the longest token in the vocabulary cannot fit, and is refused (PromptError) before the chat
    template or the tokenizer spends time on it."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None, max_tokens: int | None = None):
        self.tokenizer = tokenizer
        template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        self.chat_template: str | None = template or None
        self._lock = threading.Lock()  # encoding (worker threads)
        self._decoder = copy.deepcopy(tokenizer)
        self._decode_lock = threading.Lock()  # decoding (the event loop)
        self.max_chars: int | None = None  # characters of a prompt's text that could still fit max_tokens
        if max_tokens is not None:
            longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
            self.max_chars = max_tokens * max(longest, 1)

    @property
    def fallback_stops(self) -> tuple[str, ...]:
        """Stop strings every chat request gets: the plain fallback's, or none with a template."""
        return () if self.chat_template else FALLBACK_STOPS

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of the conversation with the assistant's turn opened. Raises PromptError when the template
        rejects the messages (e.g. roles that must alternate) or they are too long to fit."""
        self._check_length(sum(len(m["content"]) for m in messages), "messages")
        if self.chat_template is None:
            return self._encode(fallback_text(messages), True, "messages")
        try:
            with self._lock:
                text = self.tokenizer.apply_chat_template(
                    list(messages), chat_template=self.chat_template, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja2's TemplateError, or the template's own raise_exception(...)
            raise PromptError(f"the chat template rejected the messages: {e}", "messages") from e
        return self._encode(str(text), False, "messages")

    def text(self, prompt: str, param: str = "prompt") -> list[int]:
        """Token ids of a completion prompt, with the tokenizer's special tokens (as HF's tokenizer(prompt)).
        Raises PromptError when the text is too long to fit."""
        return self._encode(prompt, True, param)

    def decode(self, ids: Sequence[int]) -> str:
        with self._decode_lock:
            return self._decoder.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def token_text(self, token: int) -> str:
        """One token as text (special tokens included), for log-probabilities."""
        with self._decode_lock:
            return self._decoder.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _check_length(self, chars: int, param: str) -> None:
        if self.max_chars is not None and chars > self.max_chars:
            raise PromptError(f"the prompt has {chars} characters: more than fit in this model's context "
                              f"(at most {self.max_chars} characters)", param, "context_length_exceeded")

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        self._check_length(len(text), param)
        with self._lock:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
