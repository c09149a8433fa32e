"""Text of a completion: incremental detokenization, stop strings, chat prompts (template and plain fallback)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoTokenizer

from corolla.api.detokenizer import IncrementalDetokenizer, StopStrings
from corolla.api.prompts import FALLBACK_STOPS, PromptBuilder, PromptError, fallback_text
from corolla.api.sampling import Sampled, SamplingParams, make_generator
from corolla.api.stream import GenerationStream
from corolla.cli.demo_cmd import demo_model_path

TEMPLATE = ("{{ bos_token }}{% for m in messages %}### {{ m['role'] | capitalize }}:\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}### Assistant:\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(demo_model_path())


def deltas(tokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    d = IncrementalDetokenizer(tokenizer, prompt)
    return [d.push(i) for i in ids] + [d.flush()]


@pytest.mark.parametrize("text", ["Hello, world. Files are read by open().", "naïve café — 日本語のテキスト 🎉 done",
                                  "  leading spaces\n\ttabs and\r\nnewlines  "])
def test_deltas_concatenate_to_the_full_decode_and_never_split_a_character(tokenizer, text):
    prompt = tokenizer("Prompt:")["input_ids"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    parts = deltas(tokenizer, prompt, ids)
    assert "".join(parts) == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert not any("\ufffd" in p for p in parts)
    assert sum(1 for p in parts if p) > 3  # it streams, not all at the end


def test_random_tokens_and_special_tokens_keep_the_concatenation_exact(tokenizer):
    rng = random.Random(0)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(300)] + [2, 3, 1]
    parts = deltas(tokenizer, [1], ids)
    assert "".join(parts) == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def feed(stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    s = StopStrings(stops)
    out, stopped = [], False
    for piece in pieces:
        text, stopped = s.add(piece)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(s.finish())
    return out, stopped, s.text


def test_stop_string_split_over_deltas_is_never_sent():
    out, stopped, text = feed(["END"], ["abc E", "N", "D and more"])
    assert stopped and text == "abc " and "".join(out) == "abc "
    assert out[0] == "abc "  # "E" is held back: it may start the stop string


def test_held_back_text_is_released_when_it_does_not_become_a_stop():
    out, stopped, text = feed(["END", "\nUser:"], ["abc E", "X", "\nUs", "e", "r"])
    assert not stopped and "".join(out) == "abc EX\nUser" == text
    assert out[:2] == ["abc ", "EX"]


def test_the_earliest_stop_string_wins():
    out, stopped, text = feed(["cd", "b"], ["abcdef"])
    assert stopped and text == "a" and out == ["a"]


def test_generation_stream_finishes_on_eos_stop_string_or_length(tokenizer):
    ids = tokenizer(" one two three four", add_special_tokens=False)["input_ids"]

    def run(**kw):
        params = SamplingParams(max_tokens=kw.pop("max_tokens", 20), stop_token_ids=(2,), **kw)
        stream = GenerationStream([1], params, tokenizer, tokenizer.vocab_size, make_generator(0))
        events = []
        for token in [*ids, 2, *ids]:
            events.append(stream.accept(Sampled(token, None, [])))
            if events[-1].finish_reason:
                break
        return "".join(e.text for e in events), events[-1]

    text, last = run()
    assert (text, last.finish_reason) == (" one two three four", "stop")
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (1, len(ids) + 1)
    text, last = run(stop=(" three",))
    assert (text, last.finish_reason) == (" one two", "stop")
    text, last = run(max_tokens=2)
    assert last.finish_reason == "length" and text == tokenizer.decode(ids[:2])
    text, last = run(ignore_eos=True, max_tokens=len(ids) * 2 + 1)
    assert last.finish_reason == "length" and text == " one two three four one two three four"


def test_chat_template_renders_and_tokenizes_without_a_second_bos(tokenizer):
    builder = PromptBuilder(tokenizer, TEMPLATE)
    ids = builder.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert tokenizer.decode(ids) == "<s>### System:\nBe brief.\n### User:\nHi\n### Assistant:\n"
    assert ids.count(tokenizer.bos_token_id) == 1
    assert builder.fallback_stops == ()


def test_a_template_that_raises_is_a_prompt_error(tokenizer):
    builder = PromptBuilder(tokenizer, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(PromptError, match="roles must alternate"):
        builder.chat([{"role": "user", "content": "Hi"}])


def test_plain_fallback_without_a_template(tokenizer):
    builder = PromptBuilder(tokenizer)
    assert builder.chat_template is None and builder.fallback_stops == FALLBACK_STOPS
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": " Hello."}, {"role": "user", "content": "More?"}]
    text = fallback_text(messages)
    assert text == "System: Be brief.\nUser: Hi\nAssistant: Hello.\nUser: More?\nAssistant:"
    assert builder.chat(messages) == tokenizer(text)["input_ids"]


def test_a_reply_sent_back_retokenizes_as_generated_in_the_fallback(tokenizer):
    first = fallback_text([{"role": "user", "content": "Hi"}])
    reply = " Hello there, friend."
    generated = tokenizer(first)["input_ids"] + tokenizer(reply, add_special_tokens=False)["input_ids"]
    follow = tokenizer(fallback_text([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply},
                                      {"role": "user", "content": "Bye"}]))["input_ids"]
    assert follow[: len(generated)] == generated


def test_detokenizer_lock_allows_use_from_threads(tokenizer):
    import threading

    builder = PromptBuilder(tokenizer)
    errors = []

    def work():
        try:
            for _ in range(200):
                ids = builder.text("some words to encode")
                assert builder.decode(ids).endswith("encode")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert torch.is_tensor(torch.tensor(builder.text("x")))


def held_by_brute_force(text: str, sent: int, stops: list[str]) -> int:
    """The longest end of text (within what is not sent) that begins some stop string, by trying every length."""
    return max([k for stop in stops for k in range(1, min(len(stop) - 1, len(text) - sent) + 1)
                if text.endswith(stop[:k])], default=0)


def test_held_back_text_equals_trying_every_length_on_random_text():
    rng = random.Random(3)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 3))]
        s = StopStrings(stops)
        sent = ""
        for _ in range(rng.randint(1, 12)):
            out, stopped = s.add("".join(rng.choice("abc") for _ in range(rng.randint(0, 3))))
            sent += out
            if stopped:
                assert not any(stop in s.text for stop in stops) and sent == s.text
                break
            assert len(s.text) - len(sent) == held_by_brute_force(s.text, len(sent), stops)
            assert sent == s.text[: len(sent)]


def test_long_stop_strings_cost_little_per_token():
    """16 stop strings of the longest kind cost a token about what one short stop costs (trying every length of every
    stop at each token took ~0.6 ms a token, over 100x a short stop's). A ratio of two timings taken side by side, the best
    of three each, so that a loaded machine slows both alike."""
    import time

    def per_token(stops: list[str]) -> float:
        best = float("inf")
        for _ in range(3):
            s = StopStrings(stops)
            start = time.perf_counter()
            for _ in range(2000):
                s.add("aaaa")
            best = min(best, (time.perf_counter() - start) / 2000)
        return best

    long_stops = ["b" * 255 + chr(65 + i) for i in range(15)] + ["a" * 255 + "b"]
    assert per_token(long_stops) < 20 * per_token(["ab"])  # measured 5.5x here
