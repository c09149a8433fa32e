"""`corolla api` as a real process in front of a real swarm, driven by the official `openai` package and httpx,
exact against the local HF model: greedy text (completions and chat, streamed and not), seeded sampling,
concurrent streams, stop strings, log-probabilities, bad requests, aborted streams, prefix reuse, kept sessions
given up when the servers are full."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from api_harness import CHAT_TEMPLATE, ApiProcess, api_swarm, free_cache, metric, reference, wait_for  # noqa: F401
from corolla.api.prompts import fallback_text

CHAT = "demo-chat"
EOS = 2


def client(api: ApiProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=300)


def async_client(api: ApiProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=300)


def chat_ids(reference, messages: list[dict[str, str]]) -> list[int]:
    text = reference.tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                                   add_generation_prompt=True)
    return reference.tokenizer(text, add_special_tokens=False)["input_ids"]


def finish_of(new: list[int]) -> str:
    return "stop" if new and new[-1] == EOS else "length"


def test_models_and_health(api_swarm):
    c = client(api_swarm.chat)
    assert [m.id for m in c.models.list().data] == [CHAT]
    assert c.models.retrieve(CHAT).id == CHAT
    assert [m.id for m in client(api_swarm.plain).models.list().data] == [api_swarm.model_path]
    health = httpx.get(api_swarm.chat.root + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"


@pytest.mark.parametrize("prompt", ["The server", "A file is opened by"])
def test_completion_greedy_equals_local_hf_streamed_and_not(api_swarm, reference, prompt):
    ids = reference.tokenizer(prompt)["input_ids"]
    new, text = reference.greedy(ids, 24)
    c = client(api_swarm.chat)
    whole = c.completions.create(model=CHAT, prompt=prompt, max_tokens=24, temperature=0)
    assert whole.choices[0].text == text
    assert whole.choices[0].finish_reason == finish_of(new)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), len(new))
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    chunks = list(c.completions.create(model=CHAT, prompt=prompt, max_tokens=24, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == text
    assert chunks[-1].choices[0].finish_reason == finish_of(new)
    as_ids = c.completions.create(model=CHAT, prompt=ids, max_tokens=24, temperature=0)
    assert as_ids.choices[0].text == text


def test_chat_greedy_uses_the_chat_template_and_equals_local_hf(api_swarm, reference):
    messages = [{"role": "system", "content": "You answer in one sentence."},
                {"role": "user", "content": "What does the cp command do?"}]
    ids = chat_ids(reference, messages)
    new, text = reference.greedy(ids, 32)
    c = client(api_swarm.chat)
    whole = c.chat.completions.create(model=CHAT, messages=messages, max_tokens=32, temperature=0)
    assert whole.choices[0].message.content == text and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == finish_of(new)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), len(new))
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    parts = [{**messages[0]}, {"role": "user", "content": [{"type": "text", "text": "What does the cp "},
                                                          {"type": "text", "text": "command do?"}]}]
    stream = c.chat.completions.create(model=CHAT, messages=parts, max_completion_tokens=32, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == finish_of(new)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(new)
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_without_a_template_uses_the_plain_fallback(api_swarm, reference):
    messages = [{"role": "user", "content": "Name a file system."}]
    ids = reference.tokenizer(fallback_text(messages))["input_ids"]
    new, text = reference.greedy(ids, 40)
    expected = text.split("\nUser:")[0]
    reply = client(api_swarm.plain).chat.completions.create(model=api_swarm.model_path, messages=messages,
                                                            max_tokens=40, temperature=0)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(ids)


def test_seeded_sampling_is_reproducible_whatever_runs_beside_it(api_swarm):
    c = client(api_swarm.chat)
    kw = dict(model=CHAT, prompt="The", max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    first = c.completions.create(**kw).choices[0].text
    assert c.completions.create(**kw).choices[0].text == first
    three = [ch.text for ch in c.completions.create(**kw, n=3).choices]
    assert [ch.text for ch in c.completions.create(**kw, n=3).choices] == three

    async def crowded() -> str:
        ac = async_client(api_swarm.chat)
        noise = [ac.completions.create(model=CHAT, prompt=f"Noise {i}", max_tokens=30, temperature=1.3)
                 for i in range(3)]
        results = await asyncio.gather(ac.completions.create(**kw), *noise)
        return results[0].choices[0].text

    assert asyncio.run(crowded()) == first


def test_eight_concurrent_streams_each_equal_their_solo_output(api_swarm):
    jobs = [("completion", f"Section {i}. The", 16 + 2 * i) for i in range(4)]
    jobs += [("chat", f"Explain item {i} of the manual.", 16 + 2 * i) for i in range(4)]

    async def run(ac: openai.AsyncOpenAI, kind: str, text: str, max_tokens: int) -> str:
        if kind == "completion":
            stream = await ac.completions.create(model=CHAT, prompt=text, max_tokens=max_tokens, temperature=0,
                                                 stream=True)
            return "".join([ch.choices[0].text async for ch in stream])
        stream = await ac.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": text}],
                                                  max_tokens=max_tokens, temperature=0, stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    async def solo() -> list[str]:
        ac = async_client(api_swarm.chat)
        return [await run(ac, *job) for job in jobs]

    async def together() -> list[str]:
        ac = async_client(api_swarm.chat)
        return list(await asyncio.gather(*(run(ac, *job) for job in jobs)))

    alone = asyncio.run(solo())
    passes, single = metric(api_swarm.chat, "corolla_api_batch_rows_count"), metric(
        api_swarm.chat, "corolla_api_batch_rows_bucket", le="1.0")
    assert asyncio.run(together()) == alone
    passes = metric(api_swarm.chat, "corolla_api_batch_rows_count") - passes
    single = metric(api_swarm.chat, "corolla_api_batch_rows_bucket", le="1.0") - single
    assert passes > single  # some head passes served several streams at once


def test_stop_strings_end_the_text_before_them(api_swarm, reference):
    ids = reference.tokenizer("The server")["input_ids"]
    _, text = reference.greedy(ids, 40)
    assert len(text) > 30
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    expected = text[: text.index(stop)]
    c = client(api_swarm.chat)
    whole = c.completions.create(model=CHAT, prompt="The server", max_tokens=40, temperature=0, stop=[stop, "@@@"])
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(model=CHAT, prompt="The server", max_tokens=40, temperature=0, stop=stop,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_match_the_local_model(api_swarm, reference):
    messages = [{"role": "user", "content": "What is a directory?"}]
    ids = chat_ids(reference, messages)
    new, text = reference.greedy(ids, 8)
    expected = reference.logprobs(ids, new)
    c = client(api_swarm.chat)
    reply = c.chat.completions.create(model=CHAT, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                      top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx(expected, abs=1e-3)
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy: the top one
        assert entry.bytes == list(entry.token.encode())
    prompt = "The server"
    pids = reference.tokenizer(prompt)["input_ids"]
    pnew, ptext = reference.greedy(pids, 8)
    done = c.completions.create(model=CHAT, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(reference.logprobs(pids, pnew), abs=1e-3)
    assert all(len(top) == 2 for top in lp.top_logprobs)
    if EOS not in pnew:
        assert "".join(lp.tokens) == ptext == done.choices[0].text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_n_choices_echo_and_several_prompts(api_swarm, reference):
    c = client(api_swarm.chat)
    ids = reference.tokenizer("The server")["input_ids"]
    new, text = reference.greedy(ids, 8)
    two = c.completions.create(model=CHAT, prompt="The server", max_tokens=8, temperature=0, n=2)
    assert [(ch.index, ch.text) for ch in two.choices] == [(0, text), (1, text)]
    assert two.usage.completion_tokens == 2 * len(new) and two.usage.prompt_tokens == len(ids)
    echo = c.completions.create(model=CHAT, prompt="The server", max_tokens=8, temperature=0, echo=True)
    assert echo.choices[0].text == "The server" + text
    other_ids = reference.tokenizer("A file")["input_ids"]
    _, other = reference.greedy(other_ids, 8)
    both = c.completions.create(model=CHAT, prompt=["The server", "A file"], max_tokens=8, temperature=0)
    assert [ch.text for ch in both.choices] == [text, other]


def test_bad_requests_get_openai_style_errors(api_swarm):
    url = api_swarm.chat.url
    user = [{"role": "user", "content": "hi"}]
    cases = [
        ("/completions", {"prompt": "x"}, 400, "model"),
        ("/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/completions", {"model": CHAT, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/completions", {"model": CHAT, "prompt": "x", "temperature": 3}, 400, "temperature"),
        ("/completions", {"model": CHAT, "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
        ("/completions", {"model": CHAT, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/completions", {"model": CHAT, "prompt": "x", "n": 99}, 400, "n"),
        ("/completions", {"model": CHAT, "prompt": [5, 99999]}, 400, "prompt"),
        ("/completions", {"model": CHAT, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
        ("/completions", {"model": CHAT, "prompt": "x", "suffix": "y"}, 400, "suffix"),
        ("/completions", {"model": CHAT, "prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
        ("/completions", {"model": CHAT, "prompt": "x", "stop": 5}, 400, "stop"),
        ("/chat/completions", {"model": CHAT, "messages": []}, 400, "messages"),
        ("/chat/completions", {"model": CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
        ("/chat/completions", {"model": CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        ("/chat/completions", {"model": CHAT, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, 400, "messages[0].content"),
        ("/chat/completions", {"model": CHAT, "messages": user, "tools": [{"type": "function",
                                                                          "function": {"name": "f"}}]}, 400, "tools"),
        ("/chat/completions", {"model": CHAT, "messages": user, "stream_options": {"include_usage": True}}, 400,
         "stream_options"),
        ("/chat/completions", {"model": CHAT, "messages": user, "top_logprobs": 2}, 400, "top_logprobs"),
    ]
    for path, body, status, param in cases:
        answer = httpx.post(url + path, json=body, timeout=60)
        error = answer.json()["error"]
        assert (answer.status_code, error["param"]) == (status, param), (body, answer.text)
        assert error["message"] and error["type"] and "Traceback" not in answer.text
    broken = httpx.post(url + "/chat/completions", content=b"{not json", headers={"content-type": "application/json"},
                        timeout=60)
    assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
    ignored = httpx.post(url + "/chat/completions", json={"model": CHAT, "messages": user, "max_tokens": 2,
                                                          "temperature": 0, "some_future_field": {"x": 1}}, timeout=60)
    assert ignored.status_code == 200 and ignored.json()["usage"]["completion_tokens"] <= 2
    with pytest.raises(openai.NotFoundError):
        client(api_swarm.chat).chat.completions.create(model="gpt-4o", messages=user)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client(api_swarm.chat).chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "x " * 600}])


def test_a_swarm_without_the_models_blocks_answers_503_naming_them(api_swarm):
    api = ApiProcess(api_swarm.model_path, api_swarm.peers, ["--dht-prefix", "nobody-serves-this"], api_swarm.env)
    try:
        answer = httpx.post(api.url + "/completions", json={"model": api_swarm.model_path, "prompt": "x"}, timeout=120)
        assert answer.status_code == 503
        error = answer.json()["error"]
        assert error["code"] == "missing_blocks" and "0:6" in error["message"]
    finally:
        api.close()


def test_an_aborted_stream_frees_its_reservations_at_once(api_swarm, free_cache):
    small = api_swarm.swarm.peer_ids["small"]
    total = free_cache(small)[1]
    assert wait_for(lambda: free_cache(small)[0] == total, timeout=30)
    body = {"model": api_swarm.model_path, "prompt": "The", "max_tokens": 500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", api_swarm.plain.url + "/completions", json=body, timeout=120) as answer:
        assert answer.status_code == 200
        chunks, held = 0, total
        for line in answer.iter_lines():  # leaving this loop closes the connection
            chunks += line.startswith("data: {")
            if chunks == 4:
                held = free_cache(small)[0]
                break
        assert held <= total - 500  # the long session held its reservation while it streamed
    assert wait_for(lambda: free_cache(small)[0] == total, timeout=10)
    gone = metric(api_swarm.plain, "corolla_api_requests_total", endpoint="completions", status="499")
    with pytest.raises(httpx.ReadTimeout):  # a client giving up on a whole response ends it too
        httpx.post(api_swarm.plain.url + "/completions", json={**body, "stream": False},
                   timeout=httpx.Timeout(60, read=1.0))
    assert wait_for(lambda: free_cache(small)[0] == total, timeout=10)
    assert metric(api_swarm.plain, "corolla_api_requests_total", endpoint="completions", status="499") == gone + 1
    long = client(api_swarm.plain).completions.create(model=api_swarm.model_path, prompt="The", max_tokens=500,
                                                      temperature=0, extra_body={"ignore_eos": True})
    assert (long.usage.completion_tokens, long.choices[0].finish_reason) == (500, "length")


def test_a_follow_up_turn_sends_only_its_new_tokens_and_still_equals_hf(api_swarm, reference):
    c = client(api_swarm.chat)
    turn1 = [{"role": "user", "content": "What is a pipe in the shell?"}]
    first = c.chat.completions.create(model=CHAT, messages=turn1, max_tokens=24, temperature=0)
    turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Give an example."}]
    ids1, ids2 = chat_ids(reference, turn1), chat_ids(reference, turn2)
    sent = metric(api_swarm.chat, "corolla_api_tokens_sent_total")
    second = c.chat.completions.create(model=CHAT, messages=turn2, max_tokens=24, temperature=0)
    sent = metric(api_swarm.chat, "corolla_api_tokens_sent_total") - sent
    _, text = reference.greedy(ids2, 24)
    assert second.choices[0].message.content == text
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(ids1)
    assert sent == len(ids2) - cached + second.usage.completion_tokens - 1  # the last token is never sent


def test_kept_sessions_are_given_up_when_a_new_request_needs_their_room(api_swarm, free_cache):
    c = client(api_swarm.chat)
    given_up = metric(api_swarm.chat, "corolla_api_idle_sessions_closed_total", reason="server_full")
    # each request reserves >= 400 tokens and stops at once (EOS forced): its kept session holds that room
    for i in range(6):
        done = c.completions.create(model=CHAT, prompt=f"Note {i}:", max_tokens=400, logit_bias={str(EOS): 100})
        assert (done.usage.completion_tokens, done.choices[0].finish_reason) == (1, "stop")
    assert metric(api_swarm.chat, "corolla_api_idle_sessions_closed_total", reason="server_full") > given_up
    assert free_cache(api_swarm.swarm.peer_ids["a"])[0] < 600  # what the kept sessions hold
