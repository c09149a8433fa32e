"""Turning generated tokens into text, one token at a time, and cutting it at stop strings.

`IncrementalDetokenizer` decodes a short window of tokens before and after the new one and returns only the text
that window adds (the method of HF's TextStreamer, TGI and vLLM): a token that ends inside a multi-byte
character yields nothing until the character is complete, and a word's leading space depends on the tokens
before it as in a full decode. The window starts inside the prompt, so the first generated word keeps its space.

`StopStrings` keeps back any text that might be the start of a stop string, so the stop text is never sent, and
the concatenated deltas are exactly the final text. How much to keep back is tracked one character at a time
(Knuth-Morris-Pratt), so its cost per token does not grow with the stop strings' length: the engine runs it for
every stream on one shared thread, and one request's long stop strings must not slow everyone's steps.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

PROMPT_CONTEXT = 6  # prompt tokens the first window starts with

# Fast tokenizers are not safe to use from several threads at once (encoding may change their truncation state).
# The engine's tokenizer decodes generated tokens (here, on its head thread) and nothing else: the HTTP side encodes
# prompts with a copy of its own (prompts.PromptBuilder), so a long prompt never holds this lock.
TOKENIZER_LOCK = threading.Lock()


class IncrementalDetokenizer:
    """push(token) -> the text it adds; flush() -> text still held back (a character cut at the end)."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.ids)  # tokens before this are already turned into text

    def _decode(self, ids: list[int]) -> str:
        with TOKENIZER_LOCK:
            return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        now = self._decode(self.ids[self.prefix_offset :])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""  # nothing printable yet (a special token, or part of a character)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return now[len(before) :]

    def flush(self) -> str:
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        now = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return now[len(before) :] if len(now) > len(before) else ""


class StopStrings:
    """The completion's text so far, cut at the first stop string; `add(delta)` -> (text safe to send, stopped)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.text = ""  # the completion's text (cut before a stop string once one appears)
        self.sent = 0  # characters of text already handed out
        self._borders = [_Border(stop) for stop in self.stops]

    def add(self, delta: str) -> tuple[str, bool]:
        self.text += delta
        for border in self._borders:
            border.feed(delta)
        if not self.stops:
            return self._take(len(self.text)), False
        hits = [i for i in (self.text.find(stop, self.sent) for stop in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return self._take(len(self.text)), True
        return self._take(len(self.text) - self._held()), False

    def finish(self) -> str:
        """Everything not sent yet (the generation ended without a stop string)."""
        return self._take(len(self.text))

    def _held(self) -> int:
        """Length of the longest end of text that begins some stop string (it may still become one); never more
        than the text not sent yet (sent text was no stop's beginning, so no longer end can be one either)."""
        return min(max((b.length for b in self._borders), default=0), len(self.text) - self.sent)

    def _take(self, upto: int) -> str:
        out = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return out


class _Border:
    """The length of the longest beginning of `stop` (shorter than all of it) that the text fed so far ends with,
    kept up to date one character at a time: Knuth-Morris-Pratt, amortized O(1) per character."""

    def __init__(self, stop: str):
        self.stop = stop
        self.fail = [0] * len(stop)  # fail[i]: longest proper border of stop[: i + 1]
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k
        self.length = 0

    def feed(self, text: str) -> None:
        stop, fail, k = self.stop, self.fail, self.length
        for c in text:
            while k and (k == len(stop) or stop[k] != c):
                k = fail[k - 1]
            if stop[k] == c:
                k += 1
        self.length = k if k < len(stop) else fail[k - 1]
