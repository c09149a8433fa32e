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

from typing import Any, Sequence

from corolla.api.detokenizer import TOKENIZER_LOCK

FALLBACK_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
FALLBACK_STOPS: tuple[str, ...] = ("\nUser:",)


class PromptError(ValueError):
    """A prompt the tokenizer or chat template cannot render; `param` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def fallback_text(messages: Sequence[dict[str, str]]) -> str:
    """The plain chat prompt of the module docstring. A content's own leading space is the one after the colon
    (a reply generated after "Assistant:" starts with one), so a reply sent back re-tokenizes as generated."""
    lines = []
    for m in messages:
        content = m["content"][1:] if m["content"].startswith(" ") else m["content"]
        lines.append(f"{FALLBACK_ROLES.get(m['role'], m['role'].capitalize())}: {content}")
    return "\n".join([*lines, "Assistant:"])


class PromptBuilder:
    """Token ids of chat and completion prompts for one tokenizer. Thread-safe (tokenizer use is serialized)."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None):
        self.tokenizer = tokenizer
        template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        self.chat_template: str | None = template or None

    @property
    def fallback_stops(self) -> tuple[str, ...]:
        """Stop strings every chat request gets: the plain fallback's, or none with a template."""
        return () if self.chat_template else FALLBACK_STOPS

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of the conversation with the assistant's turn opened. Raises PromptError when the template
        rejects the messages (e.g. roles that must alternate)."""
        if self.chat_template is None:
            return self._encode(fallback_text(messages), add_special_tokens=True)
        try:
            with TOKENIZER_LOCK:
                text = self.tokenizer.apply_chat_template(
                    list(messages), chat_template=self.chat_template, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja2's TemplateError, or the template's own raise_exception(...)
            raise PromptError(f"the chat template rejected the messages: {e}", "messages") from e
        return self._encode(str(text), add_special_tokens=False)

    def text(self, prompt: str) -> list[int]:
        """Token ids of a completion prompt, with the tokenizer's special tokens (as HF's tokenizer(prompt))."""
        return self._encode(prompt, add_special_tokens=True)

    def decode(self, ids: Sequence[int]) -> str:
        with TOKENIZER_LOCK:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def token_text(self, token: int) -> str:
        """One token as text (special tokens included), for log-probabilities."""
        with TOKENIZER_LOCK:
            return self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        with TOKENIZER_LOCK:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
