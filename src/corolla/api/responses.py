"""Response bodies and stream chunks in OpenAI's exact shapes, for chat and text completions.

`ResponseFormat` builds both kinds; `chat=True` gives `chat.completion` / `chat.completion.chunk` objects
(message / delta, logprobs as `{"content": [...]}`), `chat=False` gives `text_completion` objects (text, logprobs
as tokens / token_logprobs / top_logprobs / text_offset).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from corolla.api.prompts import PromptBuilder
from corolla.api.stream import TokenLogprob, Usage


@dataclass
class ChoiceResult:
    """Everything one choice produced, collected for a non-streamed response."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ResponseFormat:
    """The bodies of one request. `wants_logprobs` decides whether choices carry log-probabilities."""

    def __init__(self, chat: bool, model: str, prompts: PromptBuilder, wants_logprobs: bool, fingerprint: str):
        self.chat = chat
        self.model = model
        self.prompts = prompts
        self.wants_logprobs = wants_logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.fingerprint = fingerprint
        self._offsets: dict[int, int] = {}  # choice index -> characters of text before its next token (completions)

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    # ------------------------------------------------------------------ streamed
    def opening_chunk(self, index: int, echo: str | None = None) -> dict[str, Any] | None:
        """The chunk a choice's stream starts with: the assistant role (chat), the echoed prompt (completions)."""
        if self.chat:
            return self.chunk(index, "", [], None, role=True)
        if echo:
            return self.chunk(index, echo, [], None)
        return None

    def chunk(self, index: int, text: str, logprobs: list[TokenLogprob], finish_reason: str | None,
              role: bool = False, include_usage: bool = False) -> dict[str, Any]:
        body = self._envelope(chunk=True)
        lp = self._logprobs(index, logprobs) if self.wants_logprobs and (logprobs or not self.chat) else None
        if self.chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            )
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        body["choices"] = [choice]
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
        return {**self._envelope(chunk=True), "choices": [], "usage": usage}

    # ------------------------------------------------------------------ whole
    def response(self, choices: list[ChoiceResult], usage: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope(chunk=False)
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            self._offsets.pop(c.index, None)
            lp = self._logprobs(c.index, c.logprobs) if self.wants_logprobs else None
            if self.chat:
                message = {"role": "assistant", "content": c.text, "refusal": None}
                out.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                out.append({"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
        body["choices"] = out
        body["usage"] = usage
        return body

    # ------------------------------------------------------------------ log-probabilities
    def _logprobs(self, index: int, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat_entry(lp) for lp in logprobs], "refusal": None}
        tokens = [self.prompts.token_text(lp.token_id) for lp in logprobs]
        offsets = []
        offset = self._offsets.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self.prompts.token_text(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }

    def _chat_entry(self, lp: TokenLogprob) -> dict[str, Any]:
        token = self.prompts.token_text(lp.token_id)
        return {
            "token": token,
            "logprob": lp.logprob,
            "bytes": list(token.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := self.prompts.token_text(i)), "logprob": v, "bytes": list(t.encode("utf-8"))}
                for i, v in lp.top
            ],
        }
