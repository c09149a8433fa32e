"""End to end over a real swarm (DHT + two server processes): exactness against the local HF model. After each test
every server's cache is free again (conftest's shared_swarms_are_left_clean)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from corolla import AutoDistributedModelForCausalLM


@pytest.fixture(scope="module")
def model(llama_swarm):
    model = AutoDistributedModelForCausalLM.from_pretrained(llama_swarm.model_path, initial_peers=llama_swarm.initial_peers, torch_dtype=torch.float32)
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def reference(llama_swarm):
    return LlamaForCausalLM.from_pretrained(llama_swarm.model_path, dtype=torch.float32).eval()


def test_swarm_logits_match_local_model(model, reference):
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (2, 17))
    with torch.no_grad():
        expected = reference(ids).logits
    assert torch.allclose(model(ids).logits, expected, atol=1e-4, rtol=0)


def test_greedy_generation_equals_hf_generate(model, reference):
    ids = torch.tensor([[1, 17, 42, 99, 5, 8, 13]])
    expected = reference.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=20), expected)


def test_two_turn_session_equals_fresh_run_of_concatenated_prompt(model, reference):
    first, second = torch.tensor([[1, 5, 9, 33]]), torch.tensor([[70, 71]])
    with model.inference_session(max_length=64) as session:
        turn1 = model.generate(first, max_new_tokens=6, session=session)
        turn2 = model.generate(second, max_new_tokens=6, session=session)  # new tokens: appended
        assert session.position == turn1.shape[1] + turn2.shape[1] - 1  # the last token is not fed yet
    fresh = reference.generate(torch.cat([turn1, second], dim=1), max_new_tokens=6, do_sample=False)
    assert torch.equal(turn2, fresh[:, turn1.shape[1]:])  # the call's ids, then the new tokens


def test_generate_uses_the_active_session_of_a_with_block(model, reference):
    ids = torch.tensor([[1, 2, 3, 4]])
    with model.inference_session(max_length=32) as session:
        out = model.generate(ids, max_new_tokens=3)
        assert session.position == out.shape[1] - 1
    assert torch.equal(out, reference.generate(ids, max_new_tokens=3, do_sample=False))


def test_sampling_with_fixed_seed_equals_hf_sampling(model, reference):
    ids = torch.tensor([[1, 40, 41, 42]])
    kwargs = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3, max_new_tokens=12)
    torch.manual_seed(123)
    expected = reference.generate(ids, **kwargs)
    torch.manual_seed(123)
    assert torch.equal(model.generate(ids, **kwargs), expected)


def test_generation_stops_at_eos_and_pads_finished_rows(model, reference):
    ids = torch.tensor([[1, 7, 7, 7]])
    greedy = reference.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    eos = int(greedy[0, ids.shape[1] + 2])  # the third generated token becomes "eos"
    out = model.generate(ids, max_new_tokens=8, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, reference.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0))
    assert out.shape[1] <= ids.shape[1] + 3


def test_streamer_receives_prompt_then_each_token(model):
    class Collect:
        def __init__(self):
            self.parts, self.ended = [], False

        def put(self, value):
            self.parts.append(value.clone())

        def end(self):
            self.ended = True

    streamer = Collect()
    ids = torch.tensor([[1, 2, 3]])
    out = model.generate(ids, max_new_tokens=4, streamer=streamer)
    assert streamer.ended and torch.equal(streamer.parts[0], ids)
    assert [int(p) for p in streamer.parts[1:]] == out[0, 3:].tolist()


def test_batched_prompts_of_equal_length_match_local(model, reference):
    ids = torch.tensor([[1, 5, 6, 7], [1, 9, 10, 11]])
    assert torch.equal(model.generate(ids, max_new_tokens=5), reference.generate(ids, max_new_tokens=5, do_sample=False))


def test_session_rollback_then_regenerate_equals_fresh_run(model, reference):
    ids = torch.tensor([[1, 3, 5, 7, 9]])
    with model.inference_session(max_length=32) as session:
        model.generate(ids, max_new_tokens=5, session=session)
        session.position = 3
        assert session.token_ids.tolist() == [[1, 3, 5]]
        out = model.generate(torch.tensor([[11, 12]]), max_new_tokens=4, session=session)
    fresh = reference.generate(torch.tensor([[1, 3, 5, 11, 12]]), max_new_tokens=4, do_sample=False)
    assert torch.equal(out, fresh[:, 3:])


def test_long_prompt_runs_block_by_block_and_still_equals_local(model, reference):
    """A 200-token prompt is past the servers' merge limit (128 tokens): each server runs it as one compute task
    per block, so other sessions can decode meanwhile. The result is the same."""
    torch.manual_seed(7)
    ids = torch.randint(3, 128, (1, 200))
    out = model.generate(ids, max_new_tokens=8)
    assert torch.equal(out, reference.generate(ids, max_new_tokens=8, do_sample=False))
