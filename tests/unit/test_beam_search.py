"""Our beam search, fed by a local HF model, returns exactly HF `generate`'s beams (eos, length penalty,
early stopping modes, several returned sequences)."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from corolla.client.decoding.beam_search import BeamSettings, beam_search
from corolla.client.decoding.settings import HF_DEFAULTS, logits_processors, stopping_criteria

PROMPTS = torch.tensor([[1, 17, 42, 99, 5], [1, 8, 13, 21, 34]])
NEW = 12


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def frequent_token(model) -> int:
    """A token greedy decoding produces often: as eos it makes beams end early."""
    greedy = model.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, eos_token_id=None)[:, PROMPTS.shape[1]:]
    return int(torch.mode(greedy.flatten()).values)


def ours(model, num_beams: int, eos: int | None, **settings) -> torch.Tensor:
    kwargs = dict(num_beams=num_beams, eos_token_id=eos, max_new_tokens=NEW, **settings)
    config = GenerationConfig(**{**HF_DEFAULTS, **kwargs})
    eos_list = [] if eos is None else [eos]
    prompt_len = PROMPTS.shape[1]
    beam = BeamSettings(
        num_beams=num_beams, max_length=prompt_len + NEW, length_penalty=config.length_penalty,
        early_stopping=config.early_stopping, num_return_sequences=config.num_return_sequences,
        n_eos=len(eos_list), fill_token=eos if eos is not None else -1,
    )
    with torch.no_grad():
        return beam_search(lambda seq, _: model(seq).logits[:, -1], PROMPTS.repeat_interleave(num_beams, 0), beam,
                           logits_processors(config, prompt_len, eos_list, None),
                           stopping_criteria(prompt_len + NEW, eos_list, None, None)).sequences


@pytest.mark.parametrize("num_beams, settings", [
    (4, {}),
    (4, {"num_return_sequences": 2}),
    (3, {"num_return_sequences": 3, "length_penalty": 0.5, "early_stopping": True}),
    (4, {"num_return_sequences": 2, "length_penalty": 2.0, "early_stopping": "never"}),
    (2, {"repetition_penalty": 1.3}),
])
@pytest.mark.parametrize("with_eos", [False, True])
def test_beam_search_equals_hf(model, frequent_token, num_beams, settings, with_eos):
    eos = frequent_token if with_eos else None
    with torch.no_grad():
        expected = model.generate(PROMPTS, do_sample=False, num_beams=num_beams, eos_token_id=eos,
                                  max_new_tokens=NEW, **settings)
    got = ours(model, num_beams, eos, **settings)
    assert torch.equal(got, expected)


def test_beams_really_end_at_eos(model, frequent_token):
    """The eos case above is not vacuous: some returned hypothesis ends before max_length."""
    got = ours(model, 4, frequent_token, num_return_sequences=4)
    generated = got[:, PROMPTS.shape[1]:]
    assert any(frequent_token in row[:-1].tolist() for row in generated)
