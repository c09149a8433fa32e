"""What every request passes before a route sees it (API keys, Host allow-list, body size) and the bounds on every
request field, over the app in process with a scripted engine (no swarm needed): each hostile request performed,
each refused with its own OpenAI-shaped error."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from corolla.api.app import build_app
from corolla.api.auth import ApiKeys, key_id
from corolla.api.config import ApiConfig
from corolla.api.hosts import AllowedHosts, host_name, is_loopback
from corolla.api.prompts import PromptBuilder
from corolla.cli.demo_cmd import demo_model_path
from test_api_app import ScriptedEngine

KEYS = ["sk-alpha-0123456789", "sk-beta-9876543210"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(demo_model_path())


def app(engine, base_url: str = "http://127.0.0.1:8000", keys: list[str] | None = None,
        client: tuple[str, int] = ("127.0.0.1", 50000), **config) -> TestClient:
    built = build_app(engine, ApiConfig(model=str(demo_model_path()), model_name="m", **config),
                      ApiKeys(keys) if keys else None)
    return TestClient(built, base_url=base_url, client=client)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---------------------------------------------------------------------- API keys
def test_with_keys_every_route_needs_a_valid_bearer_key_and_gets_openai_401s(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"])
    client = app(engine, keys=KEYS)
    body = {"model": "m", "prompt": "Hi"}
    for method, path in [("GET", "/v1/models"), ("GET", "/v1/models/m"), ("GET", "/metrics"), ("GET", "/health"),
                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/nowhere")]:
        for headers in [{}, bearer("sk-wrong"), {"Authorization": KEYS[0]}, {"Authorization": f"Basic {KEYS[0]}"},
                        bearer(KEYS[0][:-1]), bearer(KEYS[0] + "x"), bearer("")]:
            answer = client.request(method, path, json=body if method == "POST" else None, headers=headers)
            assert answer.status_code == 401, (path, headers)
            error = answer.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
            assert answer.headers["www-authenticate"] == "Bearer"
            assert KEYS[0] not in answer.text
    assert engine.submitted == []  # nothing reached the engine
    for key in KEYS:
        assert client.get("/v1/models", headers=bearer(key)).json()["data"][0]["id"] == "m"
        assert client.post("/v1/completions", json=body, headers=bearer(key)).status_code == 200
    assert engine.owners == [key_id(KEYS[0]), key_id(KEYS[1])]  # the engine learns which key, never the key
    assert client.get("/metrics", headers={"authorization": f"bearer {KEYS[1]}"}).status_code == 200


def test_with_keys_server_wide_metrics_are_for_loopback_clients_unless_made_public(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"])
    remote = app(engine, keys=KEYS, client=("192.0.2.7", 40000))
    assert remote.post("/v1/completions", json={"model": "m", "prompt": "Hi"}, headers=bearer(KEYS[0])).status_code == 200
    refused = remote.get("/metrics", headers=bearer(KEYS[1]))  # B would see A's requests and kept sessions
    assert refused.status_code == 403 and "corolla_api" not in refused.text
    assert refused.json()["error"]["code"] == "forbidden"
    assert remote.get("/metrics").status_code == 401  # the key is still checked first
    public = app(engine, keys=KEYS, client=("192.0.2.7", 40000), public_metrics=True)
    assert public.get("/metrics", headers=bearer(KEYS[1])).status_code == 200
    assert app(engine, client=("192.0.2.7", 40000)).get("/metrics").status_code == 200  # no keys: one trust domain


def test_without_keys_no_auth_is_asked_and_every_request_has_the_one_shared_owner(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"])
    client = app(engine)
    assert client.post("/v1/completions", json={"model": "m", "prompt": "Hi"}).status_code == 200
    assert client.post("/v1/completions", json={"model": "m", "prompt": "Hi"}, headers=bearer("any")).status_code == 200
    assert engine.owners == ["", ""]


def test_keys_file_ignores_blanks_and_comments_and_refuses_bad_files(tmp_path):
    good = tmp_path / "keys"
    good.write_text(f"# team keys\n\n  {KEYS[0]}  \n#{KEYS[1]}\n{KEYS[1]}\n{KEYS[0]}\n")
    keys = ApiKeys.from_file(good)
    assert len(keys) == 2
    assert keys.owner(f"Bearer {KEYS[1]}") == key_id(KEYS[1]) and keys.owner("Bearer #") is None
    assert keys.owner(None) is None and keys.owner("Bearer") is None and keys.owner("") is None
    for text, message in [("", "holds no key"), ("# only a comment\n\n", "holds no key"),
                          ("two words\n", "line 1: a key cannot contain whitespace")]:
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            ApiKeys.from_file(bad)
    with pytest.raises(ValueError, match="cannot read"):
        ApiKeys.from_file(tmp_path / "missing")
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="cannot read"):
        ApiKeys.from_file(tmp_path / "binary")


# ---------------------------------------------------------------------- Host allow-list
def test_hosts_not_allowed_are_refused_before_anything_else(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"])
    client = app(engine, keys=KEYS)
    body = {"model": "m", "prompt": "Hi"}
    for host in ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil.example", "", "a b"]:
        answer = client.post("/v1/completions", json=body, headers={**bearer(KEYS[0]), "host": host})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_host", host
    for host in ["localhost:8000", "LOCALHOST", "127.0.0.1:8000", "[::1]:8000", "chat.localhost"]:
        answer = client.post("/v1/completions", json=body, headers={**bearer(KEYS[0]), "host": host})
        assert answer.status_code == 200, host
    # the allow-list comes before auth: a rebinding page learns nothing, not even that a key is needed
    assert client.get("/v1/models", headers={"host": "evil.example"}).status_code == 400


def test_allowed_hosts_rules():
    assert is_loopback("127.0.0.2") and is_loopback("[::1]") and is_loopback("LocalHost.") and is_loopback("x.localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("localhost.example")
    assert host_name("[::1]:80") == "::1" and host_name("Api.Example:443") == "api.example"
    assert host_name("a:b") is None and host_name("[::1]x") is None and host_name("user@host") is None
    bound = AllowedHosts("10.1.2.3", ["api.example"])
    assert bound.allows("10.1.2.3:8000") and bound.allows("API.example") and bound.allows("localhost")
    assert not bound.allows("10.1.2.4") and not bound.allows("other.example") and not bound.allows(None)
    everywhere = AllowedHosts("0.0.0.0")
    assert everywhere.allows("192.168.5.5:8000", local_address="192.168.5.5")  # the address it arrived on
    assert everywhere.allows("192.168.5.5", local_address="::ffff:192.168.5.5")
    assert not everywhere.allows("192.168.5.5", local_address="192.168.5.6")
    assert not everywhere.allows("rebound.example", local_address="192.168.5.5")
    assert AllowedHosts("0.0.0.0", ["*"]).allows("anything.example")


# ---------------------------------------------------------------------- body size
def test_bodies_past_the_limit_get_413_before_being_read(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"])
    client = app(engine, max_body_bytes=1000)
    small = {"model": "m", "prompt": "Hi"}
    assert client.post("/v1/completions", json=small).status_code == 200
    big = json.dumps({"model": "m", "prompt": "x" * 2000}).encode()
    declared = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(50):
            yield b" " * 100

    chunked = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413
    lying = client.post("/v1/completions", content=big, headers={"content-type": "application/json",
                                                                 "content-length": "1" * 30})
    assert lying.status_code == 413
    assert len(engine.submitted) == 1
    text = client.get("/metrics").text
    assert 'corolla_api_requests_total{endpoint="completions",status="413"} 3.0' in text


# ---------------------------------------------------------------------- request fields
def test_every_unbounded_or_malformed_field_is_that_requests_400(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"])
    client = app(engine)
    base = {"model": "m", "prompt": "Hi"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    cases = [
        ({**base, "top_k": 2**63}, "top_k"),
        ({**base, "top_k": -2}, "top_k"),
        ({**base, "seed": 2**64}, "seed"),
        ({**base, "seed": -(2**63) - 1}, "seed"),
        ({**base, "logit_bias": {"\u00b2": 1}}, "logit_bias"),  # a digit to str.isdigit, not to int()
        ({**base, "logit_bias": {"--5": 1}}, "logit_bias"),
        ({**base, "logit_bias": {"1" * 5000: 1}}, "logit_bias"),
        ({**base, "logit_bias": {"4096": 1}}, "logit_bias"),
        ({**base, "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ({**base, "logit_bias": {"5": 1e300}}, "logit_bias"),
        ({**base, "stop": "x" * 257}, "stop"),
        ({**base, "stop": ["x"] * 17}, "stop"),
        ({**base, "n": 0}, "n"),
        ({**base, "n": 10**30}, "n"),
        ({**base, "max_tokens": 10**30}, "max_tokens"),
        ({**base, "logprobs": 21}, "logprobs"),
        ({**base, "presence_penalty": 1e308}, "presence_penalty"),
        ({**base, "prompt": "word " * 100_000}, "prompt"),  # refused before it is tokenized
        ({**base, "prompt": list(range(1, 600))}, "prompt"),  # token ids past the context
        ({**base, "prompt": [-1]}, "prompt"),
        ({**base, "prompt": ["a"] * 300}, "n"),  # more choices than the engine has streams
        ({**chat, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({**chat, "messages": [{"role": "user", "content": "x"}] * 3000}, "messages"),
        ({**chat, "messages": [{"role": "user", "content": "word " * 100_000}]}, "messages"),
    ]
    for body, param in cases:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        start = time.monotonic()
        answer = client.post(path, json=body)
        assert answer.status_code == 400, (param, answer.text[:300])
        assert answer.json()["error"]["param"] == param, answer.text[:300]
        assert time.monotonic() - start < 5
    for raw in ['{"model": "m", "prompt": "Hi", "temperature": NaN}', '{"model": "m", "prompt": "Hi", "top_p": Infinity}']:
        answer = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert answer.status_code == 400
    assert engine.submitted == []


def test_top_k_past_the_vocabulary_is_off_and_tiny_temperatures_are_greedy(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"])
    client = app(engine)
    assert client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "top_k": 10**6,
                                                 "temperature": 1e-30}).status_code == 200
    params = engine.submitted[0][1]
    assert params.top_k == 0 and params.greedy


def test_unknown_model_paths_do_not_grow_the_metrics(tokenizer):
    client = app(ScriptedEngine(tokenizer, ["ok"]))
    for i in range(20):
        assert client.get(f"/v1/models/made-up-{i}").status_code == 404
    text = client.get("/metrics").text
    assert "made-up" not in text
    assert 'corolla_api_requests_total{endpoint="models",status="404"} 20.0' in text


def test_prompts_are_encoded_with_a_tokenizer_of_their_own(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"])
    built = build_app(engine, ApiConfig(model=str(demo_model_path()), model_name="m"))
    prompts: PromptBuilder = built.state.api.prompts
    assert prompts.tokenizer is not engine.tokenizer  # a long prompt never holds the engine's decoding lock
    assert prompts.text("Hello there") == tokenizer("Hello there")["input_ids"]
    assert prompts.max_chars == engine.max_length * max(len(t) for t in tokenizer.get_vocab())
