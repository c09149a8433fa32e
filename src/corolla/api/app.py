"""The FastAPI app: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health, GET /metrics.

`build_app(engine, config)` returns the app; more routes (the swarm monitor's page) can be added to it. Every
request first passes gate.py (Host allow-list, API key, body size limit). Every error is OpenAI's JSON error shape
(see errors.py); request bodies are parsed by schemas.py and turned into token ids (prompts.py) and sampling
settings here, checked against the model's limits (token ids it can embed, its context length), then run by
generation.py on the engine for the request's owner (its API key).
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from corolla import __version__
from corolla.api import generation
from corolla.api.auth import ApiKeys
from corolla.api.config import ApiConfig
from corolla.api.engine import BatchedEngine
from corolla.api.errors import ApiError
from corolla.api.gate import RequestGate
from corolla.api.hosts import AllowedHosts
from corolla.api.metrics import endpoint_label
from corolla.api.generation import Job
from corolla.api.prompts import PromptBuilder, PromptError
from corolla.api.responses import ResponseFormat
from corolla.api.sampling import SamplingParams
from corolla.api.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
    TextPart,
    SharedFields,
)

logger = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # taken from generation_config


class _Api:
    """What the routes share: the engine, the prompt builder, the model's limits and defaults."""

    def __init__(self, engine: BatchedEngine, config: ApiConfig):
        self.engine = engine
        self.metrics = engine.metrics
        self.model_name = config.model_name or config.model
        template = Path(config.chat_template).read_text() if config.chat_template else None
        # a copy of the engine's tokenizer: encoding a prompt here never waits on, or holds up, its decoding
        self.prompts = PromptBuilder(copy.deepcopy(engine.tokenizer), template, engine.max_length)
        self.max_length = engine.max_length
        self.vocab_size = engine.vocab_size  # width of the logits (top_k past it is "off")
        self.token_limit = getattr(engine, "token_limit", engine.vocab_size)  # ids the model takes as input
        self.max_n = config.max_n
        # choices of one request: what the engine holds at once and, with keys, what one key may have at once (more
        # could never run: a 400, not a 429 a client would retry)
        keyed = config.api_keys is not None
        self.max_choices = min(config.max_streams, config.max_streams_per_key) if keyed else config.max_streams
        self.created = int(time.time())
        self.fingerprint = f"corolla-{__version__}"
        generation_config = engine.model.generation_config
        chosen = generation_config.to_diff_dict() if generation_config is not None else {}
        self.defaults = {k: chosen[k] for k in SAMPLING_DEFAULTS if chosen.get(k) is not None}
        self.stop_token_ids = _eos_ids(generation_config, engine.tokenizer)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def max_tokens(
        self, prompt_len: int, requested: int | None, default: int | None, field: str, prompt_field: str
    ) -> int:
        """The completion budget of a prompt: the request's, else the default, else the rest of the context."""
        if prompt_len == 0:
            raise ApiError.bad_request("the prompt is empty", prompt_field)
        room = self.max_length - prompt_len
        if room <= 0:
            raise ApiError.bad_request(
                f"This model's maximum context length is {self.max_length} tokens; the prompt has {prompt_len} tokens",
                prompt_field,
                "context_length_exceeded",
            )
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise ApiError.bad_request(
                f"This model's maximum context length is {self.max_length} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion)",
                field,
                "context_length_exceeded",
            )
        return requested

    def sampling(self, body: SharedFields, max_tokens: int, stops: list[str], logprobs: int | None) -> SamplingParams:
        def pick(name: str, fallback: Any) -> Any:
            value = getattr(body, name)
            return value if value is not None else self.defaults.get(name, fallback)

        bias = []
        for key, value in (body.logit_bias or {}).items():
            token = int(key)  # schemas.py: at most 10 ASCII digits
            if not 0 <= token < self.token_limit:
                raise ApiError.bad_request(
                    f"logit_bias: token id {token} is not in [0, {self.token_limit})", "logit_bias"
                )
            bias.append((token, float(value)))
        top_k = int(pick("top_k", 0))
        top_k = 0 if top_k < 0 or top_k >= self.vocab_size else top_k  # past the vocabulary: every token, i.e. off
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(pick("temperature", 1.0)),
            top_p=float(pick("top_p", 1.0)),
            top_k=top_k,
            min_p=float(pick("min_p", 0.0)),
            repetition_penalty=float(pick("repetition_penalty", 1.0)),
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias=tuple(bias),
            seed=body.seed,
            stop=tuple(stops),
            stop_token_ids=self.stop_token_ids,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
        )

    def check_counts(self, body: SharedFields, prompts: int) -> None:
        if body.n > self.max_n:
            raise ApiError.bad_request(f"n must be at most {self.max_n}", "n")
        if body.n * prompts > self.max_choices:
            raise ApiError.bad_request(f"a request may ask for at most {self.max_choices} choices (prompts x n)", "n")

    async def completions(self, body: CompletionRequest, request: Request, arrived: float) -> Response:
        body.check()
        self.check_model(body.model)
        self.check_counts(body, len(body.prompts()))
        prompts: list[list[int]] = []
        for i, prompt in enumerate(body.prompts()):
            if isinstance(prompt, str):
                try:
                    ids = await run_in_threadpool(self.prompts.text, prompt)
                except PromptError as e:
                    raise ApiError.bad_request(str(e), e.param, e.code) from None
            else:
                ids = list(prompt)
            if len(ids) >= self.max_length:
                raise ApiError.bad_request(
                    f"This model's maximum context length is {self.max_length} tokens; prompt {i} has {len(ids)} "
                    "tokens",
                    "prompt",
                    "context_length_exceeded",
                )
            if any(not 0 <= t < self.token_limit for t in ids):
                raise ApiError.bad_request(f"prompt {i} holds token ids outside [0, {self.token_limit})", "prompt")
            prompts.append(ids)
        budgets = [
            self.max_tokens(len(ids), body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens", "prompt")
            for ids in prompts
        ]
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else self.prompts.decode(p) for p in body.prompts()]
        params = self.sampling(body, min(budgets), body.stop_list(), body.logprobs)
        fmt = ResponseFormat(False, self.model_name, self.prompts, body.logprobs is not None, self.fingerprint)
        job = Job("completions", prompts, params, body.n, body.stream, body.include_usage(), echo, _owner(request))
        return await generation.run(self.engine, self.metrics, request, fmt, job, arrived)

    async def chat(self, body: ChatCompletionRequest, request: Request, arrived: float) -> Response:
        body.check()
        self.check_model(body.model)
        self.check_counts(body, 1)
        try:
            ids = await run_in_threadpool(self.prompts.chat, body.message_dicts())
        except PromptError as e:
            raise ApiError.bad_request(str(e), e.param, e.code) from None
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        budget = self.max_tokens(len(ids), body.completion_limit(), None, field, "messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self.sampling(body, budget, [*body.stop_list(), *self.prompts.fallback_stops], logprobs)
        fmt = ResponseFormat(True, self.model_name, self.prompts, body.logprobs, self.fingerprint)
        job = Job("chat.completions", [ids], params, body.n, body.stream, body.include_usage(), owner=_owner(request))
        return await generation.run(self.engine, self.metrics, request, fmt, job, arrived)

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "corolla"}


def build_app(engine: BatchedEngine, config: ApiConfig, keys: ApiKeys | None = None) -> FastAPI:
    """The API's FastAPI app over a started engine. With `keys` (else read from config.api_keys when set) every
    request needs one of them; every request's Host must be one the server answers for (hosts.py), and its body
    at most config.max_body_bytes (gate.py)."""
    if keys is None and config.api_keys:
        keys = ApiKeys.from_file(config.api_keys)
    api = _Api(engine, config)
    app = FastAPI(title="corolla", version=__version__, docs_url=None, redoc_url=None)
    app.state.api = api

    def refused(path: str, status: int) -> None:
        api.metrics.requests.labels(endpoint_label(path), str(status)).inc()

    app.add_middleware(
        RequestGate,
        hosts=AllowedHosts(config.host, config.allowed_hosts),
        keys=keys,
        max_body_bytes=config.max_body_bytes,
        on_refusal=refused,
        public_metrics=config.public_metrics,
    )

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return generation.error_response(error, api.metrics, _endpoint(request))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return generation.error_response(_validation_error(error), api.metrics, _endpoint(request))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        body = ApiError(error.status_code, str(error.detail), "invalid_request_error").body()
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception) -> JSONResponse:
        logger.error("internal error on %s", request.url.path, exc_info=error)
        body = ApiError(500, f"internal error: {type(error).__name__}", "internal_error", None, "internal_error").body()
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.running
        return JSONResponse(
            {"status": "ok" if ok else "stopped", "model": api.model_name}, status_code=200 if ok else 503
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return api.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        api.check_model(model_id)
        return api.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await api.completions(body, request, time.monotonic())

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await api.chat(body, request, time.monotonic())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(api.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _endpoint(request: Request) -> str:
    return endpoint_label(request.url.path)


def _owner(request: Request) -> str:
    """The id of the request's API key (gate.py), "" without keys."""
    return str(getattr(request.state, "owner", ""))


def _validation_error(error: RequestValidationError) -> ApiError:
    """pydantic's first complaint as OpenAI's 400, naming the field like messages[0].content."""
    problems = error.errors()
    if not problems:
        return ApiError.bad_request("invalid request body")
    first = problems[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return ApiError.bad_request(f"the body is not valid JSON: {first.get('msg', '')}")
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        return ApiError.bad_request("the body must be a JSON object")
    param = _param_name(loc)
    # a union (e.g. content: str | list of parts) reports its branch type after the field: drop pydantic's type names
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg", "invalid request"))
    return ApiError.bad_request(message, param or None)


_FIELDS = frozenset(
    name
    for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions)
    for name in model.model_fields
)


def _param_name(loc: list[Any]) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content': field names and indices, up to the first of
    pydantic's union branch labels (str, list[TextPart], function-after[...])."""
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in _FIELDS:
            name = f"{name}.{part}" if name else str(part)
        else:
            break
    return name


def _eos_ids(generation_config: Any, tokenizer: Any) -> tuple[int, ...]:
    """The tokens that end a completion: the generation config's eos ids and the tokenizer's eos token."""
    ids: list[int] = []
    value = getattr(generation_config, "eos_token_id", None)
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, int):
            ids.append(item)
    if isinstance(getattr(tokenizer, "eos_token_id", None), int):
        ids.append(tokenizer.eos_token_id)
    return tuple(sorted(set(ids)))
