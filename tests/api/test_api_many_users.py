"""`corolla api` among many callers, as real processes in front of a real swarm: a hostile request cannot fail the
honest streams it is batched with, API keys are required and keep each key's kept sessions (prefix reuse) to
itself, one key cannot take every stream slot, and oversized bodies and foreign Host headers are refused."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from api_harness import ApiProcess, api_swarm, reference  # noqa: F401
from test_api_swarm import CHAT, async_client, chat_ids

KEY_A, KEY_B = "sk-corolla-test-key-a-0123456789", "sk-corolla-test-key-b-9876543210"
BODY_LIMIT = 65536


@pytest.fixture(scope="module")
def guarded(api_swarm, tmp_path_factory):
    """`corolla api` over the chat model with two keys, at most 3 kept sessions, 3 streams per key, a 64 KiB body
    limit and `api.example` as an extra allowed Host; 64 tokens of headroom: room for a follow-up turn, no more."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# test keys\n{KEY_A}\n\n{KEY_B}\n")
    api = ApiProcess(api_swarm.chat_path, api_swarm.peers, [
        "--model-name", CHAT, "--dht-prefix", "demo_model", "--api-keys", str(keys), "--max-idle-sessions", "3",
        "--max-streams-per-key", "3", "--max-body-bytes", str(BODY_LIMIT), "--allowed-hosts", "api.example",
        "--session-headroom", "64"], api_swarm.env)
    try:
        yield api
    finally:
        api.close()


def keyed(api: ApiProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url, api_key=key, max_retries=0, timeout=300)


def async_keyed(api: ApiProcess, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=api.url, api_key=key, max_retries=0, timeout=300)


def test_hostile_requests_beside_honest_streams_fail_alone_and_the_streams_equal_hf(api_swarm, reference):
    """Four greedy streams are generating, batched; then hostile requests arrive (a top_k past int64, which once
    broke the shared sampling pass and with it every stream of the batch, and other unbounded values). Each hostile
    request gets its own 4xx; every honest stream still ends with the local HF model's exact text. (On the API over
    the small server, which keeps no sessions: the servers of the keyed tests below keep their room.)"""
    prompts = ["The server", "A file is opened by", "The manual page", "When the process"]
    expected = [reference.greedy(reference.tokenizer(p)["input_ids"], 40)[1] for p in prompts]
    api, model = api_swarm.plain, api_swarm.model_path
    hostile = [
        {"model": model, "prompt": "The", "max_tokens": 8, "top_k": 2**63},
        {"model": model, "prompt": "The", "max_tokens": 8, "top_k": 2**63, "stream": True},
        {"model": model, "prompt": "The", "max_tokens": 8, "seed": 2**64, "temperature": 1.0},
        {"model": model, "prompt": "The", "max_tokens": 8, "logit_bias": {"\u00b2": 5}},
        {"model": model, "prompt": "The", "max_tokens": 8, "logit_bias": {"1" * 5000: 5}},
        {"model": model, "prompt": "The", "max_tokens": 8, "stop": ["x" * 100_000]},
        {"model": model, "prompt": "word " * 1_000_000},
    ]

    async def scenario() -> tuple[list[str], list[int]]:
        started = [asyncio.Event() for _ in prompts]
        ac = async_client(api)

        async def honest(i: int) -> str:
            stream = await ac.completions.create(model=model, prompt=prompts[i], max_tokens=40, temperature=0,
                                                 stream=True)
            text = ""
            async for chunk in stream:
                text += chunk.choices[0].text
                started[i].set()
            return text

        async def attack(http: httpx.AsyncClient, body: dict) -> int:
            await asyncio.gather(*(e.wait() for e in started))  # every honest stream is generating now
            return (await http.post(api.url + "/completions", json=body, timeout=120)).status_code

        async with httpx.AsyncClient() as http:
            results = await asyncio.gather(*(honest(i) for i in range(len(prompts))),
                                           *(attack(http, body) for body in hostile))
        return list(results[: len(prompts)]), list(results[len(prompts) :])

    texts, statuses = asyncio.run(scenario())
    assert statuses == [400] * (len(hostile) - 1) + [413]  # the last body is past the 4 MiB default limit
    assert texts == expected


def test_with_keys_every_request_needs_one_and_a_key_gets_exact_answers(guarded, reference):
    for key in (None, "sk-wrong"):
        answer = httpx.get(guarded.url + "/models", headers={"Authorization": f"Bearer {key}"} if key else {},
                           timeout=30)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        keyed(guarded, "sk-wrong").completions.create(model=CHAT, prompt="The server", max_tokens=4)
    assert httpx.get(guarded.root + "/metrics", timeout=30).status_code == 401
    assert [m.id for m in keyed(guarded, KEY_A).models.list().data] == [CHAT]
    _, text = reference.greedy(reference.tokenizer("The server")["input_ids"], 24)
    done = keyed(guarded, KEY_B).completions.create(model=CHAT, prompt="The server", max_tokens=24, temperature=0)
    assert done.choices[0].text == text


def test_kept_sessions_serve_only_their_own_key_and_another_key_cannot_evict_them(guarded, reference):
    a, b = keyed(guarded, KEY_A), keyed(guarded, KEY_B)
    turn1 = [{"role": "user", "content": "What is a pipe in the shell?"}]
    first = a.chat.completions.create(model=CHAT, messages=turn1, max_tokens=16, temperature=0)
    turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Give an example."}]
    ids1, ids2 = chat_ids(reference, turn1), chat_ids(reference, turn2)
    _, text2 = reference.greedy(ids2, 16)
    # B sends A's conversation: it must neither continue A's session nor see that it is held
    other = b.chat.completions.create(model=CHAT, messages=turn2, max_tokens=16, temperature=0)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].message.content == text2
    # B fills the pool (3 sessions) with its own conversations: it gives up its own, never A's
    for i in range(5):
        b.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": f"Topic {i}: files"}],
                                  max_tokens=4, temperature=0)
    second = a.chat.completions.create(model=CHAT, messages=turn2, max_tokens=16, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= len(ids1)
    assert second.choices[0].message.content == text2


def test_one_key_cannot_take_more_than_its_streams_while_another_key_is_served(guarded):
    async def scenario() -> None:
        a, b = async_keyed(guarded, KEY_A), async_keyed(guarded, KEY_B)
        # three streams of key A (its whole quota), long enough to be generating throughout the checks below
        stream = await a.completions.create(model=CHAT, prompt="The", max_tokens=440, temperature=0, stream=True, n=3,
                                            extra_body={"ignore_eos": True})
        try:
            await stream.__anext__()  # the response starts once every choice has its first token
            with pytest.raises(openai.RateLimitError) as refused:
                await a.completions.create(model=CHAT, prompt="The", max_tokens=4)
            assert refused.value.status_code == 429 and refused.value.body["code"] == "rate_limit_exceeded"
            with pytest.raises(openai.BadRequestError):  # more choices than a key may ever have: no use retrying
                await b.completions.create(model=CHAT, prompt="The", max_tokens=4, n=4)
            done = await b.completions.create(model=CHAT, prompt="The", max_tokens=4, temperature=0)
            assert done.usage.completion_tokens >= 1
        finally:
            await stream.close()  # the client goes away: its streams end and give their slots back
        for _ in range(100):
            try:
                await a.completions.create(model=CHAT, prompt="The", max_tokens=4)
                return
            except openai.RateLimitError:
                await asyncio.sleep(0.1)
        raise AssertionError("the key's streams were not given back after its client went away")

    asyncio.run(scenario())


def test_oversized_bodies_and_foreign_hosts_are_refused_by_the_real_server(guarded):
    auth = {"Authorization": f"Bearer {KEY_A}", "content-type": "application/json"}
    big = b'{"model": "' + CHAT.encode() + b'", "prompt": "' + b"x" * BODY_LIMIT + b'"}'
    declared = httpx.post(guarded.url + "/completions", content=big, headers=auth, timeout=60)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: refused once what arrived passes the limit
        yield b'{"model": "' + CHAT.encode() + b'", "prompt": "'
        for _ in range(1000):
            yield b"x" * 1024
        yield b'"}'

    streamed = httpx.post(guarded.url + "/completions", content=chunked(), headers=auth, timeout=60)
    assert streamed.status_code == 413
    unauthenticated = httpx.post(guarded.url + "/completions", content=big,
                                 headers={"content-type": "application/json"}, timeout=60)
    assert unauthenticated.status_code == 401  # refused before its body is read
    for host, status in [("evil.example", 400), (f"rebound.example:{guarded.url.split(':')[2].split('/')[0]}", 400),
                         ("api.example", 200), ("localhost", 200)]:
        answer = httpx.get(guarded.url + "/models", headers={**auth, "host": host}, timeout=30)
        assert answer.status_code == status, host
    assert keyed(guarded, KEY_A).completions.create(model=CHAT, prompt="The", max_tokens=2).usage.completion_tokens >= 1
