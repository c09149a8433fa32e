"""The Llama-family block, rotary embedding and client head against the Hugging Face reference.

Tiny random models are built in memory (no downloads); weights are re-drawn larger than HF's init so that
attention is far from uniform and a wrong rotary, mask or bias shows up in the logits.
"""

from __future__ import annotations

import functools

import pytest
import torch
from reference import (
    ATOL,
    VOCAB,
    assert_bfloat16_close_to_hf,
    assert_blocks_match_hf_layers,
    assert_decode_steps_match_full_sequence,
    load_ours,
    make_caches,
    make_reference,
    run_stack,
    token_ids,
)
from transformers import (
    DynamicCache,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from corolla.models import ModelFamily, UnsupportedModelError, get_family
from corolla.models.llama import (
    LlamaBlock,
    LlamaClientHead,
    compute_inv_freq,
    kv_layout,
)

CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
}

# case id -> (model_type, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama-biases-head_dim32": ("llama", {"attention_bias": True, "mlp_bias": True, "head_dim": 32}),
    "mistral": ("mistral", {}),
    "mistral-window4": ("mistral", {"sliding_window": 4}),
    "qwen2": ("qwen2", {}),
    "qwen2-window4-from-layer1": ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "qwen3": ("qwen3", {}),
    "qwen3-biases-head_dim32": ("qwen3", {"attention_bias": True, "head_dim": 32}),
    "qwen3-window4-from-layer1": ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "rope-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    "rope-dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    "rope-llama3": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 10000.0}}),
    "rope-yarn": ("llama", {"max_position_embeddings": 1024, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0}}),
}


def make_config(model_type: str, **overrides: object) -> PretrainedConfig:
    """A 3-layer GQA config (4 query heads, 2 kv heads, hidden 64, head_dim 16, vocab 128)."""
    base: dict[str, object] = {
        "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 3, "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
    }
    if model_type == "qwen3":
        base["head_dim"] = 16  # Qwen3Config defaults head_dim to 128 instead of hidden_size / num_attention_heads
    return CONFIG_CLASSES[model_type](**{**base, **overrides})


@functools.cache
def case(case_id: str) -> tuple[torch.nn.Module, list[LlamaBlock], LlamaClientHead]:
    model_type, overrides = CASES[case_id]
    model = make_reference(make_config(model_type, **overrides))
    return (model, *load_ours(model.config, model.state_dict()))


@pytest.mark.parametrize("case_id", list(CASES))
@torch.no_grad()
def test_each_block_matches_its_hf_decoder_layer(case_id: str) -> None:
    model, blocks, head = case(case_id)
    assert_blocks_match_hf_layers(model, model.model.layers, blocks, head)


@pytest.mark.parametrize("case_id", list(CASES))
@torch.no_grad()
def test_stack_logits_match_hf_full_sequence(case_id: str) -> None:
    model, blocks, head = case(case_id)
    ids = token_ids()
    torch.testing.assert_close(run_stack(blocks, head, ids), model(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case_id", list(CASES))
@torch.no_grad()
def test_block_decode_steps_match_full_sequence(case_id: str) -> None:
    model, blocks, head = case(case_id)
    assert_decode_steps_match_full_sequence(model, blocks, head, make_caches(model.config, batch=2, s_max=32))


@pytest.mark.parametrize("case_id", ["llama", "mistral-window4", "rope-yarn", "qwen3"])
@torch.no_grad()
def test_block_without_cache_starts_rotary_at_given_position(case_id: str) -> None:
    model, blocks, head = case(case_id)
    ids = token_ids(length=6)
    expected = model(ids, position_ids=torch.arange(5, 11)[None].expand(2, -1)).logits
    torch.testing.assert_close(run_stack(blocks, head, ids, position=5), expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_dynamic_rope_past_max_positions_matches_hf_full_and_incremental() -> None:
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = make_reference(make_config("llama", max_position_embeddings=8, rope_parameters=rope))
    blocks, head = load_ours(model.config, model.state_dict())
    ids = token_ids(length=14)
    torch.testing.assert_close(run_stack(blocks, head, ids), model(ids).logits, atol=ATOL, rtol=0)

    hf_cache, caches = DynamicCache(config=model.config), make_caches(model.config, batch=2, s_max=16)
    for start, end in [(0, 6), *[(t, t + 1) for t in range(6, 12)], (12, 14)]:  # crosses max_position_embeddings
        expected = model(ids[:, start:end], past_key_values=hf_cache, use_cache=True).logits
        got = run_stack(blocks, head, ids[:, start:end], position=start, caches=caches)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=lambda m: f"tokens [{start}, {end}): {m}")


ROPE_VARIANTS: dict[str, dict] = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                    "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2, "rope_theta": 10000.0},
    "yarn-no-truncate-attention-factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512,
                                          "truncate": False, "attention_factor": 1.25, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
@pytest.mark.parametrize("seq_len", [None, 700])
def test_rope_inverse_frequencies_equal_hf_bit_for_bit(variant: str, seq_len: int | None) -> None:
    rope = dict(ROPE_VARIANTS[variant])
    config = make_config("llama", max_position_embeddings=256, head_dim=32, rope_parameters=rope)
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        hf_inv_freq, hf_scaling = type(make_reference(config).model.rotary_emb).compute_default_rope_parameters(config)
    else:
        hf_inv_freq, hf_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)
    inv_freq, scaling = compute_inv_freq(config, seq_len=seq_len)
    assert torch.equal(inv_freq, hf_inv_freq)
    assert scaling == hf_scaling


@pytest.mark.parametrize("case_id", ["qwen2", "qwen3"])
@torch.no_grad()
def test_block_runs_in_bfloat16_close_to_hf_bfloat16(case_id: str) -> None:
    model, _, _ = case(case_id)
    assert_bfloat16_close_to_hf(make_reference(model.config).to(torch.bfloat16))


@torch.no_grad()
def test_head_ties_lm_head_to_embeddings_when_config_says_so() -> None:
    model = make_reference(make_config("llama", tie_word_embeddings=True))
    state = {k: v for k, v in model.state_dict().items() if k in ("model.embed_tokens.weight", "model.norm.weight")}
    head = LlamaClientHead(model.config)
    head.load_hf_state_dict(state)  # a tied checkpoint has no lm_head.weight
    assert head.lm_head.weight is head.embed_tokens.weight
    hidden = torch.randn(2, 5, 64)
    torch.testing.assert_close(head.logits(hidden), model.lm_head(model.model.norm(hidden)), atol=ATOL, rtol=0)


@torch.no_grad()
def test_untied_head_uses_its_own_lm_head_and_requires_it() -> None:
    model, _, head = case("llama")
    assert head.lm_head.weight is not head.embed_tokens.weight
    ids = token_ids(length=4)
    torch.testing.assert_close(head.embed(ids), model.model.embed_tokens(ids), atol=0, rtol=0)
    hidden = torch.randn(2, 4, 64)
    torch.testing.assert_close(head.logits(hidden), model.lm_head(model.model.norm(hidden)), atol=ATOL, rtol=0)
    is_head_tensor = get_family(model.config).is_head_tensor
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" and is_head_tensor(k)}
    with pytest.raises(ValueError, match="lm_head.weight"):
        LlamaClientHead(model.config).load_hf_state_dict(state)


def test_block_load_names_missing_and_unexpected_keys() -> None:
    model, _, _ = case("qwen2")
    state = get_family(model.config).block_tensors(model.state_dict(), 0)
    state.pop("self_attn.q_proj.bias")
    state["self_attn.o_proj.bias"] = torch.zeros(64)  # Qwen2 has no o_proj bias
    expected = r"missing keys \['self_attn.q_proj.bias'\].*unexpected keys \['self_attn.o_proj.bias'\]"
    with pytest.raises(ValueError, match=expected):
        LlamaBlock(model.config, 0).load_hf_state_dict(state)


def test_qwen3_block_requires_its_query_and_key_norms() -> None:
    model, blocks, _ = case("qwen3")
    state = get_family(model.config).block_tensors(model.state_dict(), 0)
    assert {"self_attn.q_norm.weight", "self_attn.k_norm.weight"} <= set(blocks[0].state_dict())
    state.pop("self_attn.k_norm.weight")
    with pytest.raises(ValueError, match=r"missing keys \['self_attn.k_norm.weight'\], unexpected keys \[\]"):
        LlamaBlock(model.config, 0).load_hf_state_dict(state)


def test_block_rejects_a_cache_too_short_for_the_positions() -> None:
    _, blocks, _ = case("llama")
    k_cache, v_cache = make_caches(blocks[0].self_attn.rotary.config, batch=1, s_max=8)[0]
    with pytest.raises(ValueError, match="exceed the cache length 8"):
        blocks[0](torch.zeros(1, 3, 64), (k_cache, v_cache), position=6)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_get_family_serves_llama_mistral_qwen2_and_qwen3(model_type: str) -> None:
    config = make_config(model_type)
    family = get_family(config)
    assert isinstance(family, ModelFamily) and family.name == "llama"
    assert family.block_prefix(3) == "model.layers.3."
    assert family.num_blocks(config) == 3
    assert family.kv_layout(config) == (2, 16)
    assert family.is_head_tensor("model.norm.weight") and not family.is_head_tensor("model.layers.0.mlp.up_proj.weight")


def test_kv_layout_uses_config_head_dim_when_set() -> None:
    assert kv_layout(make_config("llama", head_dim=32)) == (2, 32)


def test_get_family_rejects_gpt2_and_lists_supported_types() -> None:
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*supported model types: ") as info:
        get_family(GPT2Config())
    assert isinstance(info.value, ValueError)
    listed = str(info.value).split("supported model types: ")[1].split(", ")
    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(listed) and listed == sorted(listed)
