"""Training through a real swarm (DHT + servers of blocks 0:2 and 2:4): gradients against local HF autograd,
chunked backward passes, deep prompt tuning, a short prompt-tuning run, and a bad backward request.

The deep-prompt reference is HF's own LlamaForCausalLM with a forward pre-hook on each decoder layer that adds
that layer's prompt to the hidden states of positions [0, P), with the prompts prepended as input embeddings.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import LlamaForCausalLM, LlamaForSequenceClassification

from corolla import (
    AutoDistributedModelForCausalLM,
    AutoDistributedModelForSequenceClassification,
)
from corolla.client.swarm.connection import Connection
from corolla.client.event_loop import run_sync
from corolla.client.swarm.remote_blocks import RemoteBlocks
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.errors import RemoteError
from corolla.protocol.messages import BackwardRequest, BlockRange

ATOL = 1e-4
P = 3  # pre_seq_len


@pytest.fixture(scope="module")
def model(llama_swarm):
    model = AutoDistributedModelForCausalLM.from_pretrained(llama_swarm.model_path, initial_peers=llama_swarm.initial_peers)
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def reference(llama_swarm):
    return LlamaForCausalLM.from_pretrained(llama_swarm.model_path, dtype=torch.float32).eval().requires_grad_(False)


def weighted_loss(logits: torch.Tensor, seed: int = 7) -> torch.Tensor:
    """A loss whose gradient reaches every logit with a different weight."""
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed))
    return (logits * weights).sum()


def embeddings_grad(run, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, d loss / d embeds) of `run(embeds)` -> logits."""
    x = embeds.clone().requires_grad_(True)
    logits = run(x)
    weighted_loss(logits).backward()
    return logits.detach(), x.grad


def test_grad_wrt_inputs_embeds_matches_local_hf_autograd(model, reference):
    torch.manual_seed(0)
    embeds = reference.model.embed_tokens(torch.randint(3, 128, (3, 9))).detach()  # (3, 9, 64)
    logits, grad = embeddings_grad(lambda x: model(inputs_embeds=x).logits, embeds)
    logits_ref, grad_ref = embeddings_grad(lambda x: reference(inputs_embeds=x).logits, embeds)
    assert torch.allclose(logits, logits_ref, atol=ATOL, rtol=0)
    assert grad.abs().max() > 1e-2  # a real gradient, not zeros
    assert torch.allclose(grad, grad_ref, atol=ATOL, rtol=0)


def test_chunked_backward_is_exact_and_sends_one_row_per_message(model, reference, monkeypatch):
    manager = model.sequence_manager
    monkeypatch.setattr(manager, "config", replace(manager.config, max_chunk_bytes=1))  # every chunk: one row
    rows = []
    backward_span = RemoteBlocks.backward_span

    async def counting(self, span, hidden, grad, prompts, mask=None):
        rows.append(hidden.shape[0])
        return await backward_span(self, span, hidden, grad, prompts, mask)

    monkeypatch.setattr(RemoteBlocks, "backward_span", counting)
    torch.manual_seed(1)
    embeds = reference.model.embed_tokens(torch.randint(3, 128, (4, 6))).detach()
    _, grad = embeddings_grad(lambda x: model(inputs_embeds=x).logits, embeds)
    _, grad_ref = embeddings_grad(lambda x: reference(inputs_embeds=x).logits, embeds)
    assert rows == [1] * 8  # 4 chunks x 2 spans
    assert torch.allclose(grad, grad_ref, atol=ATOL, rtol=0)


def test_no_grad_forward_builds_no_graph(model):
    ids = torch.randint(3, 128, (1, 5))
    assert not model(ids).logits.requires_grad


# ---------------------------------------------------------------------- deep prompt tuning
@pytest.fixture(scope="module")
def deep_model(llama_swarm):
    model = AutoDistributedModelForCausalLM.from_pretrained(
        llama_swarm.model_path, initial_peers=llama_swarm.initial_peers, tuning_mode="deep_ptune", pre_seq_len=P)
    yield model
    model.shutdown()


def hf_with_prompts(reference, ids, prompts, deep):
    """Logits (B, T, V) of HF's model for ids (B, T) with `prompts` (P, H) prepended and deep[i] (P, H) added to
    positions [0, P) right before decoder layer i; the prompt positions are dropped from the logits."""

    def adder(i):
        def hook(module, args, kwargs):
            hidden = args[0]
            hidden = torch.cat([hidden[:, :P] + deep[i], hidden[:, P:]], dim=1)
            return (hidden, *args[1:]), kwargs

        return hook

    handles = [layer.register_forward_pre_hook(adder(i), with_kwargs=True) for i, layer in enumerate(reference.model.layers)]
    try:
        embeds = reference.model.embed_tokens(ids)
        embeds = torch.cat([prompts.expand(ids.shape[0], -1, -1), embeds], dim=1)
        return reference(inputs_embeds=embeds).logits[:, P:]
    finally:
        for handle in handles:
            handle.remove()


def test_deep_prompt_grads_match_hf_with_prompt_hooks(deep_model, reference):
    tuning = deep_model.ptune
    assert {name for name, p in deep_model.named_parameters() if p.requires_grad} == {"ptune.prompts", "ptune.deep_prompts"}
    with torch.no_grad():
        tuning.deep_prompts.normal_(0, 0.5)  # non-zero, so a mistake in where they are added shows
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(2))

    deep_model.zero_grad()
    logits = deep_model(ids).logits
    weighted_loss(logits).backward()
    prompts_ref = tuning.prompts.detach().clone().requires_grad_(True)
    deep_ref = tuning.deep_prompts.detach().clone().requires_grad_(True)
    logits_ref = hf_with_prompts(reference, ids, prompts_ref, deep_ref)
    weighted_loss(logits_ref).backward()

    assert torch.allclose(logits, logits_ref, atol=ATOL, rtol=0)
    assert not torch.allclose(logits_ref, reference(ids).logits, atol=1e-2)  # the prompts matter
    assert torch.allclose(tuning.prompts.grad, prompts_ref.grad, atol=ATOL, rtol=0)
    assert tuning.deep_prompts.grad.abs().max() > 1e-2
    assert torch.allclose(tuning.deep_prompts.grad, deep_ref.grad, atol=ATOL, rtol=0)


def hf_greedy_with_prompts(reference, ids: torch.Tensor, prompts, deep, steps: int) -> torch.Tensor:
    """Greedy continuation of HF's model with the prompts (see hf_with_prompts): one full forward per token."""
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, hf_with_prompts(reference, ids, prompts, deep)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def deep_prompts_set(model, seed: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Give the model non-zero deep prompts (so a mistake in where they are added shows); returns (prompts, deep)."""
    with torch.no_grad():
        model.ptune.deep_prompts.copy_(0.5 * torch.randn(model.ptune.deep_prompts.shape, generator=torch.Generator().manual_seed(seed)))
    return model.ptune.prompts.detach().clone(), model.ptune.deep_prompts.detach().clone()


def test_deep_ptune_generation_equals_hf_with_prompt_hooks(deep_model, reference):
    prompts, deep = deep_prompts_set(deep_model)
    ids = torch.tensor([[1, 17, 42, 99]])
    expected = hf_greedy_with_prompts(reference, ids, prompts, deep, 6)
    assert not torch.equal(expected, reference.generate(ids, max_new_tokens=6, do_sample=False))  # the prompts matter
    assert torch.equal(deep_model.generate(ids, max_new_tokens=6), expected)
    with deep_model.inference_session(max_length=16) as session:  # two turns, then a rollback, in one session
        first = deep_model.generate(ids[:, :2], max_new_tokens=1, session=session)  # (1, 3)
        assert session.position == P + 2  # the prompts, then two tokens (the generated one is not fed yet)
        second = deep_model.generate(ids[:, 2:], max_new_tokens=4, session=session)  # new tokens: appended
        full = hf_greedy_with_prompts(reference, torch.cat([first, ids[:, 2:]], dim=1), prompts, deep, 4)
        assert torch.equal(second, full[:, first.shape[1]:])
        session.rollback(P + 4)  # keep the first four tokens
        assert torch.equal(session.token_ids, full[:, :4])
        again = deep_model.generate(max_new_tokens=3, session=session)  # continues: only the new tokens
        assert torch.equal(again, hf_greedy_with_prompts(reference, full[:, :4], prompts, deep, 3)[:, 4:])


def test_deep_ptune_session_replays_its_prompts_after_a_broken_stream(deep_model):
    """The second server's stream breaks after the prefill: its replacement is rebuilt by a replay that must carry
    the deep prompts again, or the next step's hidden states drift from the cache-less forward's."""
    deep_prompts_set(deep_model, seed=13)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = deep_model.block_outputs(ids)  # (1, 4, H): cache-less, prompts included and dropped again
        embeds = deep_model.head.embed(ids)
        with deep_model.inference_session(max_length=16) as session:
            first = session.step(deep_model.ptune.prepend(embeds[:, :3]))  # positions [0, P + 3)
            broken = session.chain.spans[1]
            broken.connection.close()
            last = session.step(embeds[:, 3:])  # span 1 fails, is replaced and replayed, then takes the step
            assert session.chain.spans[1] is not broken, "the broken span was not replaced"
    torch.testing.assert_close(first[:, P:], expected[:, :3], atol=ATOL, rtol=0)
    torch.testing.assert_close(last, expected[:, 3:], atol=ATOL, rtol=0)


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> left-padded ids (B, T) with pad 0 and their attention mask (B, T)."""
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


PADDED = [[9, 8, 7, 6, 5], [40, 41], [77, 3, 12]]


def test_deep_ptune_padded_batch_generates_and_trains_as_each_row_alone(deep_model):
    """Prompts in front of each row's padding: generation, logits and both prompts' gradients of a padded batch
    equal those of the rows one by one."""
    deep_prompts_set(deep_model, seed=15)
    ids, mask = left_pad(PADDED)
    got = deep_model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=4)
    for row, tokens in enumerate(PADDED):
        assert torch.equal(got[row, ids.shape[1] - len(tokens):], deep_model.generate(torch.tensor([tokens]), max_new_tokens=4)[0])

    deep_model.zero_grad()
    logits = deep_model(ids, attention_mask=mask).logits
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(8))
    (logits * weights * mask[..., None]).sum().backward()
    padded_grads = [deep_model.ptune.prompts.grad.clone(), deep_model.ptune.deep_prompts.grad.clone()]
    deep_model.zero_grad()
    for row, tokens in enumerate(PADDED):
        alone = deep_model(torch.tensor([tokens])).logits
        torch.testing.assert_close(logits[row, mask[row].bool()], alone[0].detach(), atol=ATOL, rtol=0)
        (alone[0] * weights[row, mask[row].bool()]).sum().backward()  # gradients accumulate over the rows
    torch.testing.assert_close(padded_grads[0], deep_model.ptune.prompts.grad, atol=ATOL, rtol=0)
    torch.testing.assert_close(padded_grads[1], deep_model.ptune.deep_prompts.grad, atol=ATOL, rtol=0)
    assert padded_grads[1].abs().max() > 1e-2


# ---------------------------------------------------------------------- ptune: training and generation
@pytest.fixture(scope="module")
def classifier(llama_swarm):
    torch.manual_seed(0)  # the prompts' and the score head's initial values
    model = AutoDistributedModelForSequenceClassification.from_pretrained(
        llama_swarm.model_path, initial_peers=llama_swarm.initial_peers, tuning_mode="ptune", pre_seq_len=P, num_labels=2)
    yield model
    model.shutdown()


def test_classifier_logits_match_hf_sequence_classification(classifier, llama_swarm):
    reference = LlamaForSequenceClassification.from_pretrained(llama_swarm.model_path, num_labels=2, dtype=torch.float32).eval()
    reference.score.weight.data.copy_(classifier.score.weight.data)
    prompts = classifier.ptune.prompts.detach()
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    embeds = torch.cat([prompts[None], reference.model.embed_tokens(ids)], dim=1)
    with torch.no_grad():
        expected = reference(inputs_embeds=embeds).logits  # the last position: the last token
        got = classifier(ids).logits
    assert got.shape == (1, 2) and torch.allclose(got, expected, atol=ATOL, rtol=0)


def test_classifier_pools_each_rows_last_real_token_left_or_right_padded(classifier):
    ids, mask = left_pad(PADDED)
    right_ids = torch.tensor([r + [0] * (ids.shape[1] - len(r)) for r in PADDED])
    with torch.no_grad():
        alone = torch.cat([classifier(torch.tensor([r])).logits for r in PADDED])
        torch.testing.assert_close(classifier(ids, attention_mask=mask).logits, alone, atol=ATOL, rtol=0)
        torch.testing.assert_close(classifier(right_ids, attention_mask=mask.flip(1)).logits, alone, atol=ATOL, rtol=0)


def test_prompt_tuning_alone_teaches_the_lm_a_fixed_token(classifier):
    """Only the P prompt embeddings train (the swarm's blocks and the LM head are frozen): next token 7 everywhere."""
    model = classifier.base
    ids = torch.randint(3, 128, (8, 8), generator=torch.Generator().manual_seed(5))
    optimizer = torch.optim.Adam([model.ptune.prompts], lr=0.1)
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        logits = model(ids).logits  # (8, 8, 128)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.full((64,), 7))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.85 * losses[0], losses


def test_prompt_tuning_a_classifier_lowers_its_loss(classifier):
    """Label = whether the sequence's first token is even; the prompts and the score head train together."""
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 128, (16, 8), generator=generator)
    labels = (ids[:, 0] % 2 == 0).long()
    optimizer = torch.optim.Adam([p for p in classifier.parameters() if p.requires_grad], lr=0.05)
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        loss = classifier(ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert classifier.ptune.prompts.grad.abs().max() > 0
    assert losses[-1] < 0.6 * losses[0], losses


def greedy_by_full_forwards(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy continuation without a session: one full forward (prompts included) per new token."""
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_ptune_generation_equals_greedy_argmax_of_full_forwards(classifier):
    model = classifier.base
    ids = torch.tensor([[1, 17, 42, 99]])
    assert torch.equal(model.generate(ids, max_new_tokens=4), greedy_by_full_forwards(model, ids, 4))
    with model.inference_session(max_length=16) as session:  # two turns in one session
        first = model.generate(ids[:, :2], max_new_tokens=1, session=session)
        assert session.position == P + 2  # the prompts, then two tokens (the generated one is not fed yet)
        second = model.generate(ids[:, 2:], max_new_tokens=4, session=session)
    assert torch.equal(second, greedy_by_full_forwards(model, torch.cat([first, ids[:, 2:]], dim=1), 4)[:, first.shape[1]:])


# ---------------------------------------------------------------------- bad input
def test_bad_backward_request_gets_a_clear_error_and_the_server_keeps_serving(model, reference, llama_swarm):
    peer = llama_swarm.server_peer_ids[0]  # blocks 0:2

    async def bad_request():
        connection = await Connection.open(model.swarm_node.p2p, peer, "backward", 10)
        try:
            request = BackwardRequest(protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=0, end=2))
            await connection.send(request, {"hidden": torch.randn(2, 5, 64), "grad_output": torch.randn(2, 4, 64)})
            return await connection.receive(10)
        finally:
            connection.close()

    with pytest.raises(RemoteError, match="bad_request: grad_output has shape"):
        run_sync(bad_request())
    test_grad_wrt_inputs_embeds_matches_local_hf_autograd(model, reference)  # still serving, still exact
    for proc in llama_swarm.local.processes:
        assert proc.alive(), f"{proc.name} died:\n{proc.tail()}"
