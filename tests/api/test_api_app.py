"""The HTTP layer over a scripted engine (no swarm): what reaches the engine, and OpenAI's shapes coming back."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer, GenerationConfig

from corolla.api.app import build_app
from corolla.api.config import ApiConfig
from corolla.api.handle import StreamHandle
from corolla.api.metrics import ApiMetrics
from corolla.api.stream import StreamEvent, Usage
from corolla.cli.demo_cmd import demo_model_path

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


class ScriptedEngine:
    """Answers every choice with the words of `reply`, one event each, and records what it was asked."""

    def __init__(self, tokenizer, reply: list[str], generation_config: GenerationConfig | None = None):
        self.tokenizer = tokenizer
        self.metrics = ApiMetrics()
        self.max_length = 512
        self.vocab_size = 4096
        self.token_limit = 4096
        self.running = True
        self.model = SimpleNamespace(generation_config=generation_config or GenerationConfig())
        self.reply = reply
        self.submitted: list[tuple[list[int], object, int]] = []
        self.owners: list[str] = []

    def submit_request(self, prompts, n, params, owner="", streamed=False):
        self.owners.append(owner)
        self.streamed = streamed
        return [self.submit(ids, params, j) for ids in prompts for j in range(n)]

    def submit(self, prompt_ids, params, index=0) -> StreamHandle:
        self.submitted.append((list(prompt_ids), params, index))
        handle = StreamHandle(lambda h: None, asyncio.get_running_loop())
        for i, word in enumerate(self.reply):
            last = i == len(self.reply) - 1
            handle.post(StreamEvent(text=word, token_ids=[10 + i], finish_reason="length" if last else None,
                                    usage=Usage(len(prompt_ids), len(self.reply), 0) if last else None))
        return handle


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(demo_model_path())


def app_for(engine, base_url: str = "http://127.0.0.1:8000", **config) -> TestClient:
    return TestClient(build_app(engine, ApiConfig(model=str(demo_model_path()), model_name="m", **config)),
                      base_url=base_url)


def test_chat_template_file_replaces_the_tokenizers(tokenizer, tmp_path):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    engine = ScriptedEngine(tokenizer, ["Hi", " there"])
    answer = app_for(engine, chat_template=str(tmp_path / "t.jinja")).post(
        "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "Hello"}]})
    assert answer.status_code == 200
    ids, params, _ = engine.submitted[0]
    assert tokenizer.decode(ids) == "[user] Hello\n[assistant]"
    assert params.stop == () and params.max_tokens == 512 - len(ids)  # chat default: the rest of the context
    body = answer.json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi there", "refusal": None}
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 2, "total_tokens": len(ids) + 2,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_settings_reach_the_engine_with_generation_config_defaults(tokenizer):
    engine = ScriptedEngine(tokenizer, ["x"], GenerationConfig(temperature=0.6, top_p=0.9, do_sample=True))
    client = app_for(engine)
    client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "seed": 3, "stop": "\n", "top_k": 5,
                                         "logit_bias": {"7": -100}, "n": 2})
    client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "temperature": 0, "max_tokens": 4})
    (ids, p, _), (_, p2, index), (ids3, p3, _) = engine.submitted
    assert ids == tokenizer("Hi")["input_ids"] and index == 1
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.logit_bias, p.max_tokens) == (
        0.6, 0.9, 5, 3, ("\n",), ((7, -100.0),), 16)  # completions default to 16 tokens, like OpenAI
    assert p2 == p
    assert ids3 == [1, 2, 3] and (p3.temperature, p3.top_p, p3.max_tokens) == (0.0, 0.9, 4)
    assert p.stop_token_ids == (tokenizer.eos_token_id,)
    assert engine.streamed is False  # a whole response: with spot checks, its events come once they are checked


def test_stream_is_server_sent_events_ending_in_done(tokenizer):
    engine = ScriptedEngine(tokenizer, ["a", "b"])
    with app_for(engine).stream("POST", "/v1/completions", json={"model": "m", "prompt": "x", "stream": True,
                                                                  "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and engine.streamed is True
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["a", "b"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, "length"]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


def test_metrics_and_health(tokenizer):
    client = app_for(ScriptedEngine(tokenizer, ["a"]))
    client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    client.post("/v1/completions", json={"model": "other", "prompt": "x"})
    text = client.get("/metrics").text
    assert 'corolla_api_requests_total{endpoint="completions",status="200"} 1.0' in text
    assert 'corolla_api_requests_total{endpoint="completions",status="404"} 1.0' in text
    assert client.get("/health").json() == {"status": "ok", "model": "m"}
    assert client.get("/nowhere").json()["error"]["message"] == "Not Found"
