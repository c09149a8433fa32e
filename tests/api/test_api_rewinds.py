"""The rules of api.rewinds, with plain data: where a choice rewinds to, which of its events a spot-checked
session lets out, and that a rewound stream samples again exactly what it sampled (seeded, with penalties).
The engine applying them over a real swarm with a liar: test_api_spot_checks.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from corolla.api.errors import OutputRetracted, from_exception
from corolla.api.rewinds import HeldEvents, released_tokens, rewind_plan
from corolla.api.sampling import SamplingParams, make_generator, sample_rows
from corolla.api.stream import GenerationStream, StreamEvent
from corolla.cli.demo_cmd import demo_model_path
from corolla.client.trust.verification import Rewind

VOCAB = 4096


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(demo_model_path())


def event(token: int, last: bool = False) -> StreamEvent:
    return StreamEvent(text=f"<{token}>", token_ids=[token], finish_reason="length" if last else None)


def tokens(events: list[StreamEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def test_rewind_plan_keeps_the_tokens_predicted_from_honest_outputs_and_resends_at_least_one():
    # prompt of 5 tokens, 4 generated and sent (the session holds 9 positions)
    assert rewind_plan(0, 9, 5) == (0, 0)  # the liar served from the start: the whole prompt again
    assert rewind_plan(3, 9, 5) == (3, 0)  # inside the prompt: its rest again, nothing generated kept
    assert rewind_plan(7, 9, 5) == (7, 3)  # tokens 0..2 (positions 5..7) kept, position 7's sent again
    assert rewind_plan(20, 9, 5) == (8, 4)  # never past the last position held: it is sent again
    # a finished choice of 4 tokens: its last token was never sent (the session holds 8)
    assert rewind_plan(20, 8, 5) == (7, 3)  # the last token is generated again


def test_a_whole_choice_gets_its_events_only_once_complete_and_checked():
    held = HeldEvents(streamed=False)
    for t in (10, 11, 12):
        held.add(event(t))
    assert held.release(None) == []
    held.rewind(1)  # a liar found: tokens 1 and 2 are generated again
    held.add(event(21))
    held.add(event(22, last=True))
    assert tokens(held.release(None, final=True)) == [10, 21, 22]


def test_a_streamed_choice_sends_what_the_checks_let_out_and_resends_nothing_after_a_rewind():
    held = HeldEvents(streamed=True)
    for t in (10, 11, 12, 13):
        held.add(event(t))
    assert tokens(held.release(2)) == [10, 11]  # a check covering token 2's step is still in flight
    assert held.release(0) == [] and held.release(-3) == []
    held.rewind(0)  # regenerated from the start: the same tokens where the outputs were honest
    held.add(event(10))
    held.add(event(11))
    held.add(event(32))
    assert tokens(held.release(None)) == [32]
    held.add(event(33, last=True))
    assert tokens(held.release(None, final=True)) == [33] and held.sent == [10, 11, 32, 33]


def test_a_streamed_choice_whose_sent_token_is_regenerated_differently_ends_with_an_error():
    held = HeldEvents(streamed=True)
    held.add(event(10))
    held.add(event(11))
    held.release(None)
    held.rewind(0)
    held.add(event(10))
    with pytest.raises(OutputRetracted, match="from token 1 on") as caught:
        held.add(event(12))
    error = from_exception(caught.value)
    assert (error.status, error.code) == (503, "wrong_output_sent")


def test_released_tokens_wait_for_the_checks_covering_their_positions():
    def checks(pending_from, rewind=None):
        return SimpleNamespace(rewind=rewind, pending_from=lambda: pending_from)

    assert released_tokens(checks(None), 5) is None  # nothing in flight: everything
    assert released_tokens(checks(7), 5) == 3  # tokens 0..2 were sampled from positions 4..6
    assert released_tokens(checks(0), 5) == -4  # the prompt's check: nothing yet
    assert released_tokens(checks(None, Rewind(3, "liar")), 5) == 0


@pytest.mark.parametrize("settings", [dict(temperature=0.0, repetition_penalty=1.3),
                                      dict(temperature=0.9, seed=7, presence_penalty=0.5, frequency_penalty=0.3),
                                      dict(temperature=1.1, top_p=0.9)])  # unseeded: the OS seed is replayed too
def test_a_rewound_stream_samples_again_what_it_sampled(tokenizer, settings):
    params = SamplingParams(max_tokens=12, **settings)
    stream = GenerationStream([1, 300, 301], params, tokenizer, VOCAB, make_generator(params.seed, 2))
    logits = torch.randn(12, VOCAB, generator=torch.Generator().manual_seed(0))  # (steps, V): the same each time

    def run(start: int) -> list[StreamEvent]:
        return [stream.accept(sample_rows(logits[i : i + 1], [stream.row])[0]) for i in range(start, 12)]

    first = run(0)
    assert first[-1].finish_reason == "length"
    stream.rewind(5)
    assert stream.generated == tokens(first[:5]) and stream.finish_reason is None
    again = run(5)
    assert [(e.token_ids, e.text, e.finish_reason) for e in again] == [
        (e.token_ids, e.text, e.finish_reason) for e in first[5:]]
    assert stream.text == "".join(e.text for e in first)
    with pytest.raises(ValueError):
        stream.rewind(13)
