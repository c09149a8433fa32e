"""client.decoding.stepper in process (inprocess_swarm): every decoding loop steps the session through one Stepper.

Greedy, beam search and speculative decoding through real servers' handlers equal the local HF model's; plain
decoding sends one token per step and builds no pass; a greedy decode step reaches the wire in at most 10 client
calls, with one sync/async crossing (the path docs/architecture.md traces hop by hop).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import corolla
from corolla.client.chain.pass_pipe import Pass
from corolla.client.decoding.stepper import Stepper
from corolla.client.session import inference_session
from corolla.client.swarm import connection
from corolla.protocol.messages import InferenceStep
from inprocess_swarm import InProcessModel, InProcessSwarm

PROMPT = torch.tensor([[1, 5, 17, 42, 9, 33, 64]])
PACKAGE = Path(corolla.__file__).resolve().parent


@pytest.fixture(scope="module")
def hf(tiny_llama_path):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_path).eval()


@pytest.fixture(scope="module")
def model(tiny_llama_path, hf):
    swarm = InProcessSwarm(tiny_llama_path, [(0, 2), (2, 4)])
    try:
        yield InProcessModel(swarm, hf)
        assert swarm.caches_free(), "a session's cache was not freed"
    finally:
        swarm.close()


@pytest.mark.parametrize("kwargs", [dict(), dict(num_beams=3), dict(prompt_lookup_num_tokens=3),
                                    dict(prompt_lookup_num_tokens=3, passes_in_flight=3)])
def test_every_decoding_loop_equals_hf(model, hf, kwargs):
    expected = hf.generate(PROMPT, max_new_tokens=12, do_sample=False, **{k: v for k, v in kwargs.items()
                                                                          if k != "passes_in_flight"})
    assert torch.equal(model.generate(PROMPT, max_new_tokens=12, do_sample=False, **kwargs), expected)


def test_plain_decoding_sends_one_token_per_step_and_builds_no_pass(model, hf, monkeypatch):
    built = []
    monkeypatch.setattr(Pass, "__post_init__", lambda self: built.append(self), raising=False)
    with model.open_session(max_length=32) as session:
        stepper = Stepper(session, model.embed, model.lm_logits, 0)
        sequence = PROMPT
        for _ in range(4):
            logits = stepper.next_logits(sequence)
            sequence = torch.cat([sequence, logits.argmax(-1, keepdim=True)], dim=1)
        assert session.steps == 4 and session.position == PROMPT.shape[1] + 3  # the last token is not sent yet
        assert session.exchanges == 4  # push: one request per step
    assert built == []
    assert torch.equal(sequence, hf.generate(PROMPT, max_new_tokens=4, do_sample=False))


def test_a_rejected_draft_is_rolled_back_and_overwritten(model, hf):
    with model.open_session(max_length=32) as session:
        stepper = Stepper(session, model.embed, model.lm_logits, 0)
        draft = torch.tensor([[7, 7, 7]])
        logits = stepper.verify(PROMPT, draft)  # (1, 4, V): after the prompt, and after each draft prefix
        assert logits.shape[:2] == (1, 4) and session.position == PROMPT.shape[1] + 3
        reference = hf(torch.cat([PROMPT, draft], dim=1)).logits[:, -4:]
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-4)
        kept = torch.cat([PROMPT, torch.tensor([[7, 5]])], dim=1)  # the first draft token kept, then another
        stepper.forget_rejected(kept)
        assert session.position == PROMPT.shape[1] + 1 and stepper.seen == PROMPT.shape[1] + 1
        after = stepper.next_logits(kept)
        torch.testing.assert_close(after, hf(kept).logits[:, -1], rtol=0, atol=1e-4)


def _client_frames(frames: list[inspect.FrameInfo]) -> list[str]:
    """corolla's own frames of a stack, outermost first, as 'module.function'."""
    out = []
    for info in reversed(frames):
        path = Path(info.filename).resolve()
        if PACKAGE in path.parents:
            out.append(f"{path.relative_to(PACKAGE).with_suffix('')}".replace("/", ".") + "." + info.frame.f_code.co_qualname)
    return out


def test_a_greedy_decode_step_reaches_the_wire_in_at_most_ten_client_hops(model, monkeypatch):
    crossings, wire = [], []
    original_run_sync, original_write = inference_session.run_sync, connection.write_frame

    def run_sync(coroutine, *args):
        crossings.append(_client_frames(inspect.stack()[1:]))  # the sync side: generate ... feed
        return original_run_sync(coroutine, *args)

    async def write_frame(writer, message, *args, **kwargs):
        if isinstance(message, InferenceStep) and message.position >= PROMPT.shape[1]:  # a decode step
            wire.append(_client_frames(inspect.stack()))  # the async side: Chain.run ... write_frame
        return await original_write(writer, message, *args, **kwargs)

    monkeypatch.setattr(inference_session, "run_sync", run_sync)
    monkeypatch.setattr(connection, "write_frame", write_frame)
    model.generate(PROMPT, max_new_tokens=4, do_sample=False)
    steps = [c for c in crossings if "client.session.inference_session.InferenceSession.feed" in c]
    assert len(steps) == 4 and len(crossings) == 5 and len(wire) == 3  # a crossing per step (and closing)
    sync_side = steps[-1][steps[-1].index("client.decoding.generation.generate"):] + ["client.event_loop.run_sync"]
    path = sync_side + wire[-1] + ["protocol.framing.write_frame"]  # the wrapper above stands for write_frame
    assert wire[-1][0] == "client.chain.chain.Chain.run" and "client.chain.chain.Chain.run" not in sync_side
    assert len(path) <= 10, "a greedy step takes more than 10 client hops:\n" + "\n".join(path)
