"""The Hugging Face surface of the distributed models, against the local HF model and real ecosystem code.

Embeddings, config/device/dtype/generation_config, `labels` -> HF's loss, `inputs_embeds` in forward and generate
(sessions included), `dtype=` / `torch_dtype=`, custom logits processors and stopping criteria merged as HF merges
them, the classifier's surface, and HF `Trainer` running prompt tuning through the swarm with the losses a
hand-written loop gets.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM, Trainer, TrainingArguments
from transformers.generation.logits_process import LogitsProcessor, RepetitionPenaltyLogitsProcessor
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteria

from corolla import AutoDistributedModelForCausalLM, AutoDistributedModelForSequenceClassification

IDS = torch.tensor([[1, 17, 42, 99, 5, 8, 13], [1, 3, 77, 64, 20, 31, 9]])


@pytest.fixture(scope="module")
def surface(varied_llama_swarm):
    """Two servers (blocks 0:2, 2:4) of a tiny Llama whose greedy output varies (conftest's varied_llama_swarm,
    shared with test_generation), a float32 client, HF's model."""
    path, peers = varied_llama_swarm.model_path, varied_llama_swarm.peers
    model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=peers, dtype=torch.float32)
    try:
        yield dict(path=path, peers=peers, model=model,
                   reference=LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    finally:
        model.shutdown()


def test_embeddings_config_device_dtype_and_generation_config_are_hfs(surface):
    model, reference = surface["model"], surface["reference"]
    embeddings = model.get_input_embeddings()
    assert isinstance(embeddings, nn.Embedding) and torch.equal(embeddings.weight, reference.get_input_embeddings().weight)
    assert torch.equal(model.get_output_embeddings().weight, reference.get_output_embeddings().weight)
    assert model.config.vocab_size == reference.config.vocab_size == 128
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert model.generation_config.bos_token_id == 1 and model.generation_config.eos_token_id == 2


def test_set_input_embeddings_changes_what_the_model_computes_as_in_hf(surface):
    model, reference = surface["model"], surface["reference"]
    original = model.get_input_embeddings()
    changed = nn.Embedding(128, 64)
    with torch.no_grad():
        changed.weight.copy_(original.weight)
        changed.weight[17] = 0.5  # token 17's embedding is different now
    hf_original = reference.get_input_embeddings()
    try:
        model.set_input_embeddings(changed)
        reference.set_input_embeddings(changed)
        with torch.no_grad():
            expected = reference(IDS).logits
        torch.testing.assert_close(model(IDS).logits, expected, atol=1e-4, rtol=0)
    finally:
        model.set_input_embeddings(original)
        reference.set_input_embeddings(hf_original)
    with torch.no_grad():
        assert not torch.allclose(model(IDS).logits, expected, atol=1e-3)


def test_labels_give_hfs_shifted_cross_entropy_with_minus_100_ignored(surface):
    model, reference = surface["model"], surface["reference"]
    labels = IDS.clone()
    labels[0, :3] = -100
    labels[1, 5] = -100
    mask = torch.ones_like(IDS)
    with torch.no_grad():
        expected = reference(IDS, attention_mask=mask, labels=labels).loss
        got = model(IDS, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.loss, expected, atol=1e-5, rtol=0)
    assert got.loss.dtype == torch.float32 and got.logits.shape == (2, 7, 128)
    with pytest.raises(ValueError, match="labels must have shape"):
        model(IDS, labels=labels[:, :3])


def test_inputs_embeds_work_wherever_input_ids_do(surface):
    model, reference = surface["model"], surface["reference"]
    embeds = model.get_input_embeddings()(IDS).detach()  # (2, 7, 64)
    torch.testing.assert_close(model(inputs_embeds=embeds).logits, model(IDS).logits, atol=1e-5, rtol=0)
    alone = model.generate(inputs_embeds=embeds, max_new_tokens=6)  # HF returns only the new tokens here
    assert torch.equal(alone, reference.generate(inputs_embeds=embeds, max_new_tokens=6, do_sample=False))
    assert alone.shape == (2, 6)
    both = model.generate(IDS, inputs_embeds=embeds, max_new_tokens=6)
    assert torch.equal(both, reference.generate(IDS, inputs_embeds=embeds, max_new_tokens=6, do_sample=False))
    capped = model.generate(inputs_embeds=embeds, max_length=10)  # max_length counts the embedded prompt, as in HF
    assert torch.equal(capped, reference.generate(inputs_embeds=embeds, max_length=10, do_sample=False))
    with pytest.raises(ValueError, match="same tokens"):
        model.generate(IDS[:, :3], inputs_embeds=embeds)


def test_inputs_embeds_then_new_tokens_in_one_session_equal_hf_on_all_embeddings(surface):
    model, reference = surface["model"], surface["reference"]
    first = model.get_input_embeddings()(IDS[:1]).detach()
    second = torch.tensor([[70, 71]])
    with model.inference_session(max_length=32) as session:
        out1 = model.generate(inputs_embeds=first, session=session, max_new_tokens=4)
        assert (session.token_ids[0, :7] == -1).all()  # the session knows those positions only as embeddings
        out2 = model.generate(second, session=session, max_new_tokens=4)
    embed = reference.get_input_embeddings()
    everything = torch.cat([first, embed(out1), embed(second)], dim=1).detach()
    expected = reference.generate(inputs_embeds=everything, max_new_tokens=4, do_sample=False)
    assert torch.equal(out2, torch.cat([second, expected], dim=1))


def test_dtype_and_torch_dtype_both_set_the_client_dtype(surface):
    for kwargs in ({"dtype": torch.bfloat16}, {"torch_dtype": "bfloat16"}):
        model = AutoDistributedModelForCausalLM.from_pretrained(surface["path"], initial_peers=surface["peers"], **kwargs)
        try:
            assert model.dtype == torch.bfloat16 and model.get_input_embeddings().weight.dtype == torch.bfloat16
        finally:
            model.shutdown()
    with pytest.raises(ValueError, match="disagree"):
        AutoDistributedModelForCausalLM.from_pretrained(surface["path"], initial_peers=surface["peers"],
                                                        dtype=torch.float32, torch_dtype=torch.bfloat16)


class BanTokens(LogitsProcessor):
    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        scores[:, self.tokens] = -float("inf")
        return scores


class StopWhenAnyRowEmits(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return (input_ids[:, -1] == self.token).any().expand(input_ids.shape[0])


def test_custom_logits_processors_and_stopping_criteria_merge_as_in_hf(surface):
    model, reference = surface["model"], surface["reference"]
    greedy = reference.generate(IDS, max_new_tokens=10, do_sample=False, eos_token_id=None)[:, 7:]
    banned = [int(greedy[0, 0]), int(greedy[1, 1])]
    stop = int(greedy[1, 4])
    for kwargs in (
        dict(logits_processor=[BanTokens(banned)]),
        dict(stopping_criteria=[StopWhenAnyRowEmits(stop)]),
        # the same type as one generate builds itself: the custom one takes its place (HF warns and uses it)
        dict(logits_processor=[RepetitionPenaltyLogitsProcessor(3.0)], repetition_penalty=1.3),
        dict(stopping_criteria=[MaxLengthCriteria(max_length=10)]),
        dict(logits_processor=[BanTokens(banned)], num_beams=3),
    ):
        expected = reference.generate(IDS, max_new_tokens=10, do_sample=False, eos_token_id=None, **kwargs)
        assert torch.equal(model.generate(IDS, max_new_tokens=10, eos_token_id=None, **kwargs), expected), kwargs
        plain = {k: v for k, v in kwargs.items() if k not in ("logits_processor", "stopping_criteria")}
        without = reference.generate(IDS, max_new_tokens=10, do_sample=False, eos_token_id=None, **plain)
        assert not torch.equal(expected, without), f"{kwargs} changes nothing: the test would not see it ignored"
    assert model.generate(IDS, max_new_tokens=10, stopping_criteria=[MaxLengthCriteria(max_length=10)]).shape == (2, 10)


def test_the_classifier_has_the_surface_too(surface):
    classifier = AutoDistributedModelForSequenceClassification.from_pretrained(
        surface["path"], initial_peers=surface["peers"], dtype=torch.float32, num_labels=3)
    try:
        embeddings = classifier.get_input_embeddings()
        assert embeddings is classifier.base.get_input_embeddings() and classifier.get_output_embeddings() is None
        assert classifier.dtype == torch.float32 and classifier.device == torch.device("cpu")
        with torch.no_grad():
            by_ids = classifier(IDS, labels=torch.tensor([0, 2]))
            by_embeds = classifier(inputs_embeds=embeddings(IDS), labels=torch.tensor([0, 2]))
        torch.testing.assert_close(by_embeds.logits, by_ids.logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(by_embeds.loss, by_ids.loss, atol=1e-5, rtol=0)
    finally:
        classifier.shutdown()


def test_hf_trainer_prompt_tunes_through_the_swarm_with_the_losses_of_a_hand_written_loop(surface, tmp_path):
    """4 Trainer steps (AdamW, linear decay, gradient clipping at 1.0, 2 batches of 4 in order) over the prompts of
    a ptune model; the same by hand from the same prompts. The logged losses must be the hand loop's."""
    model = AutoDistributedModelForCausalLM.from_pretrained(surface["path"], initial_peers=surface["peers"],
                                                            dtype=torch.float32, tuning_mode="ptune", pre_seq_len=3)
    try:
        ids = torch.randint(3, 128, (8, 12), generator=torch.Generator().manual_seed(5))
        labels = ids.clone()
        labels[:, :4] = -100  # no loss on the first tokens, as for a prompt
        data = [{"input_ids": ids[i], "attention_mask": torch.ones(12, dtype=torch.long), "labels": labels[i]}
                for i in range(8)]
        start = model.ptune.prompts.detach().clone()
        steps, lr = 4, 0.05
        args = TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=steps, learning_rate=lr,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, train_sampling_strategy="sequential",
            optim="adamw_torch", seed=0, disable_tqdm=True, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        trained = model.ptune.prompts.detach().clone()

        with torch.no_grad():
            model.ptune.prompts.copy_(start)
        optimizer = torch.optim.AdamW([model.ptune.prompts], lr=lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (steps - step) / steps)
        losses = []
        for step in range(steps):
            rows = slice(4 * (step % 2), 4 * (step % 2) + 4)
            loss = model(input_ids=ids[rows], attention_mask=torch.ones(4, 12, dtype=torch.long), labels=labels[rows]).loss
            loss.backward()
            nn.utils.clip_grad_norm_([model.ptune.prompts], 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    finally:
        model.shutdown()
    assert logged == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert losses[2] < losses[0] and losses[3] < losses[1], "the prompts did not learn"
    torch.testing.assert_close(model.ptune.prompts.detach(), trained, atol=1e-5, rtol=0)
