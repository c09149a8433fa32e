"""Generation the way HF users expect it, through a real swarm, exact against the local HF model: greedy, beam
search, seeded sampling, left-padded batches (generate and forward), rollback, stop strings, bad hypo ids, and
`corolla chat` driven through a pseudo-terminal."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pexpect
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

import corolla
from corolla import AutoDistributedModelForCausalLM
from corolla.client.swarm.connection import Connection
from corolla.client.event_loop import run_sync
from corolla.client.swarm.server_info import request_info
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.errors import RemoteError
from corolla.protocol.messages import BlockRange, InferenceStep, OpenSession, SessionOpened

PROMPT = torch.tensor([[1, 17, 42, 99, 5, 8, 13]])


@pytest.fixture(scope="module")
def swarm(varied_llama_swarm):
    """Two servers (blocks 0:2 and 2:4) of a tiny Llama with a word-level tokenizer (conftest's varied_llama_swarm,
    shared with test_hf_surface), a float32 client, the local HF model."""
    path, peers = varied_llama_swarm.model_path, varied_llama_swarm.peers
    model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=peers, torch_dtype=torch.float32)
    try:
        yield dict(path=path, peers=peers, peer_ids=varied_llama_swarm.server_peer_ids, model=model,
                   tokenizer=AutoTokenizer.from_pretrained(path),
                   reference=LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    finally:
        model.shutdown()


@pytest.fixture
def model(swarm):
    return swarm["model"]


@pytest.fixture
def reference(swarm):
    return swarm["reference"]


def test_greedy_equals_hf(model, reference):
    expected = reference.generate(PROMPT, max_new_tokens=12, do_sample=False)
    assert len(set(expected[0, PROMPT.shape[1]:].tolist())) > 3, "degenerate checkpoint"
    assert torch.equal(model.generate(PROMPT, max_new_tokens=12), expected)


@pytest.mark.parametrize("settings", [{}, {"num_return_sequences": 2, "length_penalty": 0.7, "early_stopping": True}])
def test_beam_search_equals_hf(model, reference, settings):
    prompts = torch.cat([PROMPT, torch.tensor([[1, 3, 77, 64, 20, 31, 9]])])
    greedy = reference.generate(prompts, max_new_tokens=10, do_sample=False, eos_token_id=None)[:, 7:]
    eos = int(torch.mode(greedy.flatten()).values)  # a frequent token: some beams end early
    kwargs = dict(max_new_tokens=10, num_beams=4, eos_token_id=eos, pad_token_id=0, **settings)
    expected = reference.generate(prompts, do_sample=False, **kwargs)
    got = model.generate(prompts, **kwargs)
    assert torch.equal(got, expected)
    assert got.shape[0] == 2 * settings.get("num_return_sequences", 1)


def test_beam_search_survives_a_broken_stream_by_replaying_reordered_history(model, reference):
    """The second server's stream breaks mid-search: its replacement is rebuilt from the reordered history."""
    kwargs = dict(max_new_tokens=10, num_beams=4, eos_token_id=None)
    expected = reference.generate(PROMPT, do_sample=False, **kwargs)
    with model.inference_session(max_length=32, batch_size=4) as session:
        original_feed, calls, replaced = session.feed, [0], []

        def feed(embeddings, attention_mask=None, last=None):
            calls[0] += 1
            if calls[0] == 5:  # a decode step carrying a reordering: break span 1's stream before it is sent
                replaced.append(session.chain.spans[1])
                session.chain.spans[1].connection.close()
            return original_feed(embeddings, attention_mask, last)

        session.feed = feed
        got = model.generate(PROMPT, session=session, **kwargs)
        assert replaced and session.chain.spans[1] is not replaced[0], "the broken span was not replaced"
    assert torch.equal(got, expected)


def test_sampling_with_a_seed_equals_hf(model, reference):
    kwargs = dict(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=40, top_p=0.95)
    torch.manual_seed(7)
    expected = reference.generate(PROMPT.repeat(2, 1), **kwargs)
    torch.manual_seed(7)
    got = model.generate(PROMPT.repeat(2, 1), **kwargs)
    assert torch.equal(got, expected)
    assert not torch.equal(got[0], got[1]), "both rows sampled the same tokens: the test would not see misordered draws"


def left_pad(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


PADDED_PROMPTS = [[1, 5, 9], [1, 17, 42, 99, 5, 8], [1, 70, 71, 33]]


def test_left_padded_batch_equals_each_prompt_alone(model, reference):
    ids, mask = left_pad(PADDED_PROMPTS)
    kwargs = dict(max_new_tokens=8, eos_token_id=None)
    got = model.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs)
    assert torch.equal(got, reference.generate(ids, attention_mask=mask, pad_token_id=0, do_sample=False, **kwargs))
    for row, prompt in enumerate(PADDED_PROMPTS):
        alone = model.generate(torch.tensor([prompt]), **kwargs)
        assert torch.equal(got[row, ids.shape[1] - len(prompt):], alone[0])
        assert torch.equal(alone, reference.generate(torch.tensor([prompt]), do_sample=False, **kwargs))


def test_left_padded_forward_logits_equal_each_prompt_alone(model, reference):
    ids, mask = left_pad(PADDED_PROMPTS)
    logits = model(ids, attention_mask=mask).logits
    for row, prompt in enumerate(PADDED_PROMPTS):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits[row, mask[row].bool()], expected, atol=1e-4, rtol=0)


def test_rollback_then_generate_equals_a_fresh_run(model, reference):
    with model.inference_session(max_length=64) as session:
        first = model.generate(PROMPT, max_new_tokens=8, session=session)
        keep = PROMPT.shape[1] + 3
        session.rollback(keep)
        assert session.position == keep and torch.equal(session.token_ids, first[:, :keep])
        again = model.generate(None, max_new_tokens=6, session=session)  # continues: only the new tokens
        assert torch.equal(again, reference.generate(first[:, :keep], max_new_tokens=6, do_sample=False)[:, keep:])
        session.position = 4  # assigning rolls back too; then a new turn
        turn = model.generate(torch.tensor([[70, 71]]), max_new_tokens=5, session=session)
    assert torch.equal(turn, reference.generate(torch.cat([first[:, :4], torch.tensor([[70, 71]])], 1),
                                                max_new_tokens=5, do_sample=False)[:, 4:])


def test_stop_strings_stop_where_hf_stops(model, reference):
    # the demo model's byte-level BPE tokenizer: ids below 128 are single characters
    tokenizer = AutoTokenizer.from_pretrained(Path(corolla.__file__).parent / "demo_model")
    greedy = reference.generate(PROMPT, max_new_tokens=12, do_sample=False, eos_token_id=None)
    n = PROMPT.shape[1]
    stop = tokenizer.decode(greedy[0, n + 4 : n + 6])  # the text of the 5th and 6th generated tokens
    kwargs = dict(max_new_tokens=12, stop_strings=[stop], tokenizer=tokenizer, eos_token_id=None)
    expected = reference.generate(PROMPT, do_sample=False, **kwargs)
    got = model.generate(PROMPT, **kwargs)
    assert torch.equal(got, expected)
    assert got.shape[1] <= n + 6 and tokenizer.decode(got[0, n:]).endswith(stop)


def test_bad_hypo_ids_get_a_clear_error_and_the_server_keeps_serving(swarm, model, reference):
    peer = swarm["peer_ids"][0]

    async def bad_step():
        connection = await Connection.open(model.swarm_node.p2p, peer, "inference", 10)
        try:
            await connection.send(OpenSession(protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=0, end=2),
                                              max_length=8, batch_size=2))
            reply, _ = await connection.receive(10)
            assert isinstance(reply, SessionOpened)
            await connection.send(InferenceStep(step_id=1, position=0, hypo_ids=[0, 5]), {"hidden": torch.zeros(2, 1, 64)})
            await connection.receive(10)
        finally:
            connection.close()

    with pytest.raises(RemoteError, match=r"bad_request.*hypo_ids \[5\] out of range \[0, 2\)"):
        run_sync(bad_step())
    with model.inference_session(max_length=8, batch_size=2) as session:
        with pytest.raises(ValueError, match="hypo_ids"):
            session.reorder([0, 2])
    assert torch.equal(model.generate(PROMPT, max_new_tokens=4), reference.generate(PROMPT, max_new_tokens=4, do_sample=False))


def test_chat_answers_two_turns_in_one_session(swarm, model, reference):
    """`corolla chat` in a pseudo-terminal: both turns answered as HF would, in one session on each server."""
    args = ["-m", "corolla.cli.main", "chat", swarm["path"], "--initial-peers", *swarm["peers"],
            "--max-new-tokens", "4", "--max-length", "64"]
    sessions = lambda: [run_sync(request_info(model.swarm_node.p2p, p)).active_sessions for p in swarm["peer_ids"]]  # noqa: E731
    child = pexpect.spawn(sys.executable, args, encoding="utf-8", timeout=120)
    answers, open_sessions = [], []
    try:
        child.expect_exact("you> ")
        for line in ("w17 w42 w99", "w5 w8"):
            child.sendline(line)
            child.expect_exact("model> ")
            child.expect_exact("you> ")
            answers.append(re.findall(r"\bw\d+\b", child.before))
            open_sessions.append(sessions())
        child.sendline("")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert open_sessions == [[1, 1], [1, 1]], "the chat should keep exactly one session on each server"
    turn1 = reference.generate(torch.tensor([[17, 42, 99]]), max_new_tokens=4, do_sample=False)
    turn2 = reference.generate(torch.cat([turn1, torch.tensor([[5, 8]])], 1), max_new_tokens=4, do_sample=False)
    decode = lambda ids: swarm["tokenizer"].decode(ids, skip_special_tokens=True).split()  # noqa: E731
    assert answers == [decode(turn1[0, 3:]), decode(turn2[0, turn1.shape[1] + 2:])]
    assert answers[0] and answers[1]
