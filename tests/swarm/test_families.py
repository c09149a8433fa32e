"""Every supported model family through a real swarm, exact against its local HF model.

One swarm per family (a DHT peer and two servers splitting the 4 blocks as 0:2 and 2:4), shared by that
family's tests here and in test_speculative (conftest's SharedSwarms). The client pushes steps server to server (the default); greedy generation is also checked with the
client relaying every hop (`push=False`). The checkpoints are tiny random ones written here by transformers' own `save_pretrained`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    FalconConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from conftest import NamedSwarm, start_named_servers
from corolla import AutoDistributedModelForCausalLM, ClientConfig
from corolla.cli.local_swarm import LocalSwarm

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, bos_token_id=1, eos_token_id=2,
              initializer_range=0.05)
LLAMA_LIKE = dict(COMMON, intermediate_size=96, num_hidden_layers=4, num_key_value_heads=2, max_position_embeddings=256)

# family case -> (config class, config kwargs); every case has 4 blocks.
CASES: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "llama": (LlamaConfig, LLAMA_LIKE),
    "mistral-window8": (MistralConfig, dict(LLAMA_LIKE, sliding_window=8)),
    "qwen2": (Qwen2Config, LLAMA_LIKE),
    "qwen3": (Qwen3Config, dict(LLAMA_LIKE, head_dim=32)),
    # a tied head at a small init repeats the last token forever: a larger init keeps greedy output varied
    "bloom": (BloomConfig, dict(COMMON, n_layer=4, initializer_range=0.3)),
    "falcon-7b-style": (FalconConfig, dict(COMMON, num_hidden_layers=4, multi_query=True, parallel_attn=True,
                                           new_decoder_architecture=False, bias=False, alibi=False,
                                           initializer_range=0.2)),  # tied too: see bloom
    "falcon-40b-style": (FalconConfig, dict(COMMON, num_hidden_layers=4, new_decoder_architecture=True, num_kv_heads=2,
                                            bias=False, alibi=False, tie_word_embeddings=False)),
    "mixtral": (MixtralConfig, dict(LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2)),
}


def write_checkpoint(directory: Path, case: str) -> Path:
    config_class, kwargs = CASES[case]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config_class(**kwargs)).eval().save_pretrained(directory)
    return directory


def start_family_swarm(case: str):
    """A starter for conftest's SharedSwarms: `case`'s checkpoint on two servers (0:2, 2:4), shared with
    test_speculative."""
    def start(local: LocalSwarm, directory: Path) -> NamedSwarm:
        path = str(write_checkpoint(directory / case, case))
        return start_named_servers(local, path, {f"{case}-{blocks}": ["--blocks", blocks] for blocks in ("0:2", "2:4")})
    return start


@pytest.fixture(scope="module", params=list(CASES))
def family(request, shared_swarms):
    """(case name, distributed model, HF reference, initial peers) with a live two-server swarm behind it."""
    case = request.param
    swarm = shared_swarms.for_fixture(request, start_family_swarm(case))
    model = AutoDistributedModelForCausalLM.from_pretrained(swarm.model_path, initial_peers=swarm.peers,
                                                            torch_dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(swarm.model_path, dtype=torch.float32).eval()
    try:
        yield case, model, reference, swarm.peers
    finally:
        model.shutdown()


def test_swarm_logits_match_local_model(family):
    _, model, reference, _ = family
    ids = torch.randint(3, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
    torch.testing.assert_close(model(ids).logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("push", [True, False], ids=["push", "relay"])
def test_greedy_generation_equals_hf_generate(family, push):
    case, model, reference, peers = family
    ids = torch.tensor([[1, 17, 42, 99, 5, 8, 13]])
    expected = reference.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert len(set(expected[0, ids.shape[1]:].tolist())) > 2, "degenerate checkpoint: greedy output barely varies"
    if not push:
        model = AutoDistributedModelForCausalLM.from_pretrained(model.config.name_or_path, initial_peers=peers,
                                                                torch_dtype=torch.float32,
                                                                client_config=ClientConfig(push=False))
    try:
        with model.inference_session(max_length=64) as session:
            assert torch.equal(model.generate(ids, max_new_tokens=20, eos_token_id=None, session=session), expected)
            assert session.pushed_steps == (session.steps if push else 0) and session.steps == 20, case
    finally:
        if not push:
            model.shutdown()


def test_two_turn_session_equals_fresh_run_of_concatenated_prompt(family):
    _, model, reference, _ = family
    first, second = torch.tensor([[1, 5, 9, 33]]), torch.tensor([[70, 71]])
    with model.inference_session(max_length=64) as session:
        turn1 = model.generate(first, max_new_tokens=6, session=session, eos_token_id=None)
        turn2 = model.generate(second, max_new_tokens=6, session=session, eos_token_id=None)
    fresh = reference.generate(torch.cat([turn1, second], dim=1), max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(turn2, fresh[:, turn1.shape[1]:])  # the call's ids, then the new tokens


def test_left_padded_batch_equals_each_prompt_alone(family):
    """Padded slots are skipped on the servers: positions (rotary, ALiBi) and keys count only real tokens."""
    _, model, reference, _ = family
    prompts = [[1, 5, 9], [1, 17, 42, 99, 5, 8], [1, 70, 71, 33]]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(max_new_tokens=6, eos_token_id=None)
    got = model.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs)
    logits = model(ids, attention_mask=mask).logits
    for row, prompt in enumerate(prompts):
        alone = reference.generate(torch.tensor([prompt]), do_sample=False, **kwargs)
        assert torch.equal(got[row, width - len(prompt):], alone[0])
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits[row, mask[row].bool()], expected, atol=1e-4, rtol=0)
