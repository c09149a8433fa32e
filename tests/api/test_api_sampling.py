"""The API's batched sampling pass: each row exactly as it would be sampled alone, HF's and OpenAI's rules."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from corolla.api.sampling import RowState, SamplingParams, make_generator, sample_rows

VOCAB = 50


def row(seed: int | None = 0, prompt: list[int] | None = None, **kw) -> RowState:
    params = SamplingParams(max_tokens=16, seed=seed, **kw)
    return RowState(params, prompt or [1, 2, 3], VOCAB, make_generator(seed))


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax_and_top_k_one_too():
    x = logits(3)
    out = sample_rows(x, [row(temperature=0.0), row(top_k=1), row(temperature=0.0, seed=None)])
    assert [s.token for s in out] == x.argmax(-1).tolist()


def test_a_seeded_row_samples_the_same_tokens_whatever_shares_its_batch():
    x = logits(1, seed=3).expand(4, VOCAB).clone()
    a, b = row(seed=7, temperature=0.9), row(seed=7, temperature=0.9)
    seq_alone = [sample_rows(x[:1], [a])[0].token for _ in range(20)]
    crowd = [row(seed=s, temperature=1.3, top_p=0.8) for s in (1, 2)] + [row(temperature=0.0)]
    seq_batched = [sample_rows(x, [crowd[0], b, crowd[1], crowd[2]])[1].token for _ in range(20)]
    assert seq_alone == seq_batched
    assert len(set(seq_alone)) > 1  # it does sample


def test_choices_of_one_seed_get_different_generators():
    first = torch.rand(8, generator=make_generator(5, 0))
    assert torch.equal(first, torch.rand(8, generator=make_generator(5, 0)))
    assert not torch.equal(first, torch.rand(8, generator=make_generator(5, 1)))


@pytest.mark.parametrize("settings, warper", [
    (dict(top_k=5), TopKLogitsWarper(5)),
    (dict(top_p=0.7), TopPLogitsWarper(0.7)),
    (dict(min_p=0.2), MinPLogitsWarper(0.2)),
])
def test_filters_keep_exactly_the_tokens_hf_keeps(settings, warper):
    x = logits(1, seed=11)
    allowed = set(torch.nonzero(warper(None, x.clone())[0] > -float("inf")).flatten().tolist())
    r = row(seed=1, **settings)
    drawn = {sample_rows(x, [r])[0].token for _ in range(400)}
    assert drawn <= allowed
    assert len(drawn) >= min(len(allowed), 2)


def test_sampling_follows_the_tempered_distribution():
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-1e9] * (VOCAB - 4)])
    r = row(seed=2, temperature=0.7)
    counts = torch.bincount(torch.tensor([sample_rows(x, [r])[0].token for _ in range(4000)]), minlength=VOCAB)
    expected = torch.softmax(x[0] / 0.7, -1)
    assert torch.allclose(counts.float() / 4000, expected, atol=0.03)


def test_repetition_penalty_matches_hf_over_prompt_and_completion():
    x = logits(1, seed=5)
    r = row(temperature=0.0, repetition_penalty=1.7, prompt=[4, 9])
    r.observe(12)
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[4, 9, 12]]), x.clone())
    assert sample_rows(x, [r])[0].token == int(hf.argmax())
    penalized = torch.tensor([4, 9, 12])
    boosted = x.clone()
    boosted[0, penalized] += 100  # make the seen tokens the argmax unless penalized correctly
    assert sample_rows(boosted, [r])[0].token == int(RepetitionPenaltyLogitsProcessor(1.7)(
        torch.tensor([[4, 9, 12]]), boosted.clone()).argmax())


def test_presence_and_frequency_penalties_count_the_completion_only():
    x = torch.zeros(1, VOCAB)
    x[0, 3], x[0, 4], x[0, 5] = 5.0, 4.5, 4.0
    r = row(temperature=0.0, presence_penalty=1.0, prompt=[4])  # the prompt's 4 is not penalized
    assert sample_rows(x, [r])[0].token == 3
    r.observe(3)
    assert sample_rows(x, [r])[0].token == 4  # 5 - 1 < 4.5
    f = row(temperature=0.0, frequency_penalty=0.3)
    for _ in range(2):
        f.observe(3)
    assert sample_rows(x, [f])[0].token == 4  # 5 - 0.6 < 4.5


def test_logit_bias_can_force_or_ban_a_token():
    x = logits(1, seed=9)
    top = int(x.argmax())
    assert sample_rows(x, [row(temperature=0.0, logit_bias=((7, 100.0),))])[0].token == 7
    assert sample_rows(x, [row(temperature=0.0, logit_bias=((top, -100.0),))])[0].token != top


def test_logprobs_are_the_models_distribution_before_penalties_and_temperature():
    x = logits(2, seed=4)
    rows = [row(temperature=0.0, logprobs=3, repetition_penalty=2.0), row(seed=3, temperature=0.5)]
    out = sample_rows(x, rows)
    reference = torch.log_softmax(x[0], -1)
    assert out[0].logprob == pytest.approx(float(reference[out[0].token]), abs=1e-6)
    top_values, top_ids = reference.topk(3)
    assert [t for t, _ in out[0].top] == top_ids.tolist()
    assert [v for _, v in out[0].top] == pytest.approx(top_values.tolist(), abs=1e-6)
    assert out[1].logprob is None and out[1].top == []


def test_wrong_shape_is_an_error():
    with pytest.raises(ValueError):
        sample_rows(logits(2), [row()])
