"""Sessions across generate calls, on the embedded demo model through a 2-server swarm, exact against local HF.

The seed's "Generate With Session" chat loop is run as written (greedy instead of sampling): every turn passes the
whole conversation, re-tokenized, and the session sends the servers only what they do not hold. Petals-style
callers pass only new tokens. Each rule of client.session.session_state is checked against HF `generate` on the context
the rule implies, and by counting the positions the session sends.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from corolla import AutoDistributedModelForCausalLM
from corolla.client.event_loop import run_sync
from corolla.client.chain.chain import Chain

PENALTY = 1.2  # the seed's repetition_penalty: it reads the whole context, so a wrong context shows


@pytest.fixture(scope="module")
def demo(demo_swarm):
    """The demo model's 6 blocks on two servers (0:3, 3:6), a float32 client, the local HF model and tokenizer."""
    swarm = demo_swarm
    model = AutoDistributedModelForCausalLM.from_pretrained(swarm.model_path, initial_peers=swarm.peers, dtype=torch.float32)
    try:
        yield dict(model=model, tokenizer=AutoTokenizer.from_pretrained(swarm.model_path),
                   reference=AutoModelForCausalLM.from_pretrained(swarm.model_path, dtype=torch.float32).eval())
    finally:
        model.shutdown()


@pytest.fixture
def model(demo):
    return demo["model"]


@pytest.fixture
def sent_positions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of positions of every step any session sends, in order."""
    sent: list[int] = []
    original = Chain.run

    async def counting(self, step):
        sent.append(step.hidden.shape[1])
        return await original(self, step)

    monkeypatch.setattr(Chain, "run", counting)
    return sent


def hf(demo, ids: torch.Tensor, new: int) -> torch.Tensor:
    return demo["reference"].generate(ids, max_new_tokens=new, do_sample=False, repetition_penalty=PENALTY)


def test_the_seeds_chat_loop_as_written_equals_hf_every_turn_and_sends_the_history_once(demo, model, sent_positions):
    tokenizer = demo["tokenizer"]
    user_inputs = iter(["What is a file system?", "How do I copy a file?", "Thank you. What does the licence say?", "quit"])
    printed: list[str] = []
    turns: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def input(prompt: str) -> str:  # noqa: A001 (the loop below calls input() and print() as the seed does)
        return next(user_inputs)

    def print(text: str) -> None:  # noqa: A001
        printed.append(text)

    # ---- the seed's "Interactive REPL Loop", word for word but for the marked arguments ----
    conversation = ""
    with model.inference_session(max_length=512) as session:  # seed: 4096 (the demo model has 512 positions)
        while True:
            user_input = input("You: ")
            if user_input.lower() == "quit":
                break

            conversation += f"Human: {user_input}\nAssistant:"
            inputs = tokenizer(conversation, return_tensors="pt")["input_ids"]

            outputs = model.generate(
                inputs,
                session=session,
                max_new_tokens=40,  # seed: 200
                do_sample=False,  # seed: do_sample=True, temperature=0.7
                repetition_penalty=1.2,
            )
            full_text = tokenizer.decode(outputs[0], skip_special_tokens=True)

            # Extract just the new response
            assistant_response = full_text[len(conversation):]
            conversation = full_text + "\n"
            print(f"Assistant: {assistant_response}")
            turns.append((inputs, outputs, session.position))
    # ---- end of the seed's loop ----

    assert len(turns) == 3
    for (inputs, outputs, _), text in zip(turns, printed):
        expected = hf(demo, inputs, 40)
        assert torch.equal(outputs, expected), "a turn differs from HF generate on the same ids"
        reply = tokenizer.decode(expected[0, inputs.shape[1]:], skip_special_tokens=True)
        assert text == f"Assistant: {reply}" and reply.strip()
    inputs, outputs, position = turns[-1]
    assert position == outputs.shape[1] - 1  # every token but the last generated one is on the servers
    assert abs(position - len(tokenizer(conversation)["input_ids"])) <= 2  # about the conversation's length
    assert position <= sum(sent_positions) <= position + len(turns), "the history was sent more than once"


def test_new_tokens_only_turns_equal_hf_on_the_concatenation(demo, model, sent_positions):
    """Petals style: each turn passes only its own text; a BOS-led turn is still new tokens."""
    tokenizer = demo["tokenizer"]
    texts = ["Human: What is a file system?\nAssistant:", "\nHuman: How do I copy a file?\nAssistant:",
             "\nHuman: Thanks.\nAssistant:"]
    context = torch.empty(1, 0, dtype=torch.long)
    with model.inference_session(max_length=256) as session:
        for turn, text in enumerate(texts):
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=turn != 1)["input_ids"]  # turns 1, 3: BOS-led
            assert session.read_call(ids, leading_ids=[tokenizer.bos_token_id]).kind == ("fresh" if turn == 0 else "new")
            out = model.generate(ids, session=session, max_new_tokens=16, repetition_penalty=PENALTY)
            expected = hf(demo, torch.cat([context, ids], dim=1), 16)
            assert torch.equal(out, expected[:, context.shape[1]:]), f"turn {turn} differs from HF on the concatenation"
            context = expected
        assert session.position == context.shape[1] - 1 == sum(sent_positions)


def test_a_re_tokenized_reply_end_rolls_back_and_equals_hf(demo, model):
    """The caller's next text continues the reply's last word, so re-tokenizing the conversation changes the
    session's last token(s): the session keeps the common prefix and the result equals HF on the new ids."""
    tokenizer = demo["tokenizer"]
    conversation = "Human: What is a file system?\nAssistant:"
    first = tokenizer(conversation, return_tensors="pt")["input_ids"]
    with model.inference_session(max_length=256) as session:
        out = model.generate(first, session=session, max_new_tokens=4, repetition_penalty=PENALTY)
        text = tokenizer.decode(out[0], skip_special_tokens=True)
        held = out[0].tolist()
        for suffix in ("s", "ing", "ed", "ample", "ype", "ication", "ation", "er"):
            ids = tokenizer(text + suffix + "\nHuman: Go on.\nAssistant:", return_tensors="pt")["input_ids"]
            if ids[0, : len(held)].tolist() != held:
                break
        else:
            pytest.fail(f"no suffix re-tokenizes the end of {text!r}")
        reading = session.read_call(ids, leading_ids=[tokenizer.bos_token_id])
        assert reading.kind == "rollback" and first.shape[1] <= reading.shared < len(held)
        again = model.generate(ids, session=session, max_new_tokens=12, repetition_penalty=PENALTY)
        assert torch.equal(again, hf(demo, ids, 12))
        assert session.position == again.shape[1] - 1


def test_a_conversation_extending_the_session_sends_only_the_rest(demo, model, sent_positions):
    ids = torch.tensor([[1, 400, 900, 35, 2000, 77, 512]])
    with model.inference_session(max_length=128) as session:
        first = model.generate(ids, session=session, max_new_tokens=8, repetition_penalty=PENALTY)
        sent_positions.clear()
        more = torch.cat([first, torch.tensor([[600, 601, 602]])], dim=1)
        again = model.generate(more, session=session, max_new_tokens=8, repetition_penalty=PENALTY)
        assert sent_positions[0] == 4  # the last generated token and the three new ones; nothing before them
        assert torch.equal(again, hf(demo, more, 8))


def test_a_conversation_differing_before_the_servers_end_rolls_them_back(demo, model, sent_positions):
    """Token level: the call repeats the input and part of the reply, then differs: the servers' caches are cut
    back to the shared prefix (they held 7 + 7 positions, the call shares 7 + 4) and the rest is sent."""
    ids = torch.tensor([[1, 400, 900, 35, 2000, 77, 512]])
    with model.inference_session(max_length=128) as session:
        first = model.generate(ids, session=session, max_new_tokens=8, repetition_penalty=PENALTY)
        assert session.position == 14
        changed = torch.cat([first[:, :11], torch.tensor([[3000, 3001]])], dim=1)
        assert session.read_call(changed, leading_ids=[1]).shared == 11
        sent_positions.clear()
        again = model.generate(changed, session=session, max_new_tokens=8, repetition_penalty=PENALTY)
        assert sent_positions[0] == 2 and session.position == 13 + 7
        assert torch.equal(again, hf(demo, changed, 8))


def test_continuing_with_none_and_rolling_back_equal_hf(demo, model):
    ids = torch.tensor([[1, 400, 900, 35, 2000, 77, 512]])
    with model.inference_session(max_length=128) as session:
        first = model.generate(ids, session=session, max_new_tokens=5, repetition_penalty=PENALTY)
        more = model.generate(None, session=session, max_new_tokens=5, repetition_penalty=PENALTY)  # only the new ones
        assert torch.equal(torch.cat([first, more], dim=1), hf(demo, ids, 10))
        session.rollback(9)
        again = model.generate(None, session=session, max_new_tokens=4, repetition_penalty=PENALTY)
        assert torch.equal(again, hf(demo, first[:, :9], 4)[:, 9:])
        regenerated = model.generate(first[:, :9], session=session, max_new_tokens=4, repetition_penalty=PENALTY)
        assert torch.equal(regenerated, hf(demo, first[:, :9], 4))


def test_a_call_past_the_sessions_max_length_fails_before_sending_and_loses_nothing(demo, model, sent_positions):
    ids = torch.tensor([[1, 400, 900, 35]])
    with model.inference_session(max_length=16) as session:
        first = model.generate(ids, session=session, max_new_tokens=4, repetition_penalty=PENALTY)
        held, position, steps = session.token_ids, session.position, len(sent_positions)
        with pytest.raises(ValueError, match="max_length=16 is too short"):
            model.generate(torch.tensor([[5, 6, 7]]), session=session, max_new_tokens=10, repetition_penalty=PENALTY)
        assert torch.equal(session.token_ids, held) and session.position == position and len(sent_positions) == steps
        more = model.generate(None, session=session, max_new_tokens=4, repetition_penalty=PENALTY)
    assert torch.equal(torch.cat([first, more], dim=1), hf(demo, ids, 8))


def test_sessions_stepped_concurrently_from_the_client_loop_equal_hf(demo, model):
    """step_async/feed_async/close_async: one coroutine drives two sessions at once on the client's event loop."""
    prompts = [torch.tensor([[1, 400, 900, 35, 2000]]), torch.tensor([[1, 77, 512, 8]])]

    async def greedy(ids: torch.Tensor, new: int) -> torch.Tensor:
        session = model.open_session(max_length=ids.shape[1] + new)
        try:
            hidden = await session.feed_async(model.embed(input_ids=ids))  # (1, T, H)
            for _ in range(new - 1):
                token = model.lm_logits(hidden[:, -1:]).argmax(-1)  # (1, 1)
                ids = torch.cat([ids, token], dim=1)
                hidden = await session.step_async(model.embed(input_ids=token))
            return torch.cat([ids, model.lm_logits(hidden[:, -1:]).argmax(-1)], dim=1)
        finally:
            await session.close_async()

    async def both() -> list[torch.Tensor]:
        return list(await asyncio.gather(*(greedy(p, 8) for p in prompts)))

    with torch.no_grad():
        outputs = run_sync(both())
    for ids, out in zip(prompts, outputs):
        assert torch.equal(out, demo["reference"].generate(ids, max_new_tokens=8, do_sample=False))
