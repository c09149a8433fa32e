"""Request bodies of /v1/completions and /v1/chat/completions, as OpenAI defines them (plus a few extensions).

Unknown fields are ignored, as OpenAI does; a bad value of a known field is a 400 naming it (app.py turns
pydantic's validation errors into OpenAI's error shape; `check()` raises ApiError for the rest). Every field is
bounded here, before anything reaches the engine: the engine batches the sampling of many requests' streams, so
a value it cannot hold (a top_k past int64, a logit_bias key that is not an integer) must be this request's 400,
never a failure of the batch. The bounds that depend on the model (token ids, the context length, prompt
characters) are checked in app.py. Extensions, as vLLM names them: `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`. Fields that change what the model must do and that corolla does not do
(`tools`, `response_format` other than text, `suffix`, `best_of` other than n, `echo` with `logprobs`) are 400s
rather than being silently ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from corolla.api.errors import ApiError

MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters of one stop string (each generated token is checked against every stop)
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_TOP_K = 2**31 - 1  # larger values are 400s; values past the vocabulary mean "off"
MAX_MESSAGES = 2048  # chat messages per request
INT64 = 2**63  # seeds are signed 64-bit integers, as OpenAI's
TOKEN_KEY = re.compile(r"-?[0-9]{1,10}")  # a logit_bias key: a decimal token id (ASCII digits only)


StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text: a string, or its text parts joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SharedFields(_Body):
    """The fields both endpoints share."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    seed: Annotated[int, Field(ge=-INT64, lt=INT64)] | None = None
    user: str | None = None
    # extensions (vLLM's names)
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] | None = None  # 0 or -1: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    ignore_eos: bool = False

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not TOKEN_KEY.fullmatch(key):
                raise ValueError(f"keys must be token ids (decimal integers), got {key[:20]!r}")
        return value

    def check(self) -> None:
        """Raise ApiError (400) for combinations the field types cannot express or that are not supported."""
        if self.stream_options is not None and not self.stream:
            raise ApiError.bad_request("stream_options is only allowed when stream is true", "stream_options")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


PromptIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(SharedFields):
    prompt: (
        str | PromptIds | Annotated[list[str], Field(min_length=1)] | Annotated[list[PromptIds], Field(min_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise ApiError.bad_request("suffix (insertion) is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError.bad_request("only best_of equal to n is supported", "best_of")
        if self.echo and self.logprobs is not None:
            raise ApiError.bad_request(
                "echo together with logprobs (prompt log-probabilities) is not supported", "echo"
            )

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatCompletionRequest(SharedFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.tools and self.tool_choice != "none":
            raise ApiError.bad_request("tool calling (tools) is not supported", "tools")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ApiError.bad_request("only the text response_format is supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError.bad_request("top_logprobs is only allowed when logprobs is true", "top_logprobs")
        for i, message in enumerate(self.messages):
            if message.role in ("user", "system", "developer") and message.content is None:
                raise ApiError.bad_request(
                    f"messages[{i}].content is required for role {message.role}", f"messages[{i}].content"
                )

    def completion_limit(self) -> int | None:
        """max_completion_tokens, else max_tokens (deprecated by OpenAI, still widely sent)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
