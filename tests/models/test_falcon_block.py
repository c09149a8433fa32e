"""The Falcon block and client head against the Hugging Face reference.

Tiny random models are built in memory (no downloads); weights are re-drawn larger than HF's init so that
attention is far from uniform and a wrong QKV split, rotary, mask or bias shows up in the logits.
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
    assert_unchanged,
    load_ours,
    make_caches,
    make_reference,
    run_stack,
    token_ids,
)
from torch import Tensor
from transformers import FalconConfig

from corolla.models import ModelFamily, get_family
from corolla.models.falcon import FalconBlock, FalconClientHead

NORM_NAMES = ("input_layernorm.weight", "post_attention_layernorm.weight", "ln_attn.weight", "ln_mlp.weight",
              "ln_f.weight")

# case id -> config overrides
CASES: dict[str, dict] = {
    "7b-multi-query": {},
    "7b-multi-query-bias": {"bias": True},
    "40b-grouped-kv2-untied": {"new_decoder_architecture": True, "num_kv_heads": 2, "tie_word_embeddings": False},
    "11b-grouped-one-layernorm": {"new_decoder_architecture": True, "num_kv_heads": 2, "num_ln_in_parallel_attn": 1},
    "mha-sequential-bias": {"multi_query": False, "parallel_attn": False, "bias": True},
    "mha-parallel": {"multi_query": False},
    "rope-linear-theta500": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}},
}
KV_HEADS: dict[str, int] = {
    "7b-multi-query": 1, "7b-multi-query-bias": 1, "40b-grouped-kv2-untied": 2, "11b-grouped-one-layernorm": 2,
    "mha-sequential-bias": 4, "mha-parallel": 4, "rope-linear-theta500": 1,
}


def make_config(**overrides: object) -> FalconConfig:
    """A 3-layer Falcon-7B-style config (4 query heads of 16, multi-query, parallel attention, hidden 64)."""
    base: dict[str, object] = {
        "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "num_hidden_layers": 3,
        "vocab_size": VOCAB, "max_position_embeddings": 64, "layer_norm_epsilon": 1e-5,
    }
    return FalconConfig(**{**base, **overrides})


@functools.cache
def case(case_id: str) -> tuple[torch.nn.Module, list[FalconBlock], FalconClientHead]:
    model = make_reference(make_config(**CASES[case_id]), norms=NORM_NAMES)
    return (model, *load_ours(model.config, model.state_dict()))


def layer0_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """Block 0's checkpoint tensors, with the block prefix stripped."""
    return get_family(model.config).block_tensors(model.state_dict(), 0)


@pytest.mark.parametrize("case_id", list(CASES))
@torch.no_grad()
def test_each_block_matches_its_hf_decoder_layer(case_id: str) -> None:
    model, blocks, head = case(case_id)
    assert_blocks_match_hf_layers(model, model.transformer.h, blocks, head)


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
    caches = make_caches(model.config, batch=2, s_max=32)
    assert caches[0][0].shape == (2, KV_HEADS[case_id], 32, 16)
    assert_decode_steps_match_full_sequence(model, blocks, head, caches)


@pytest.mark.parametrize("case_id", ["7b-multi-query", "40b-grouped-kv2-untied", "mha-sequential-bias"])
@torch.no_grad()
def test_block_without_cache_starts_rotary_at_given_position(case_id: str) -> None:
    model, blocks, head = case(case_id)
    ids = token_ids(length=6)
    expected = model(ids, position_ids=torch.arange(5, 11)[None].expand(2, -1)).logits
    torch.testing.assert_close(run_stack(blocks, head, ids, position=5), expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_block_runs_in_bfloat16_close_to_hf_bfloat16() -> None:
    model, _, _ = case("40b-grouped-kv2-untied")
    assert_bfloat16_close_to_hf(make_reference(model.config, norms=NORM_NAMES).to(torch.bfloat16))


@torch.no_grad()
def test_head_ties_lm_head_to_embeddings_by_default() -> None:
    model, _, _ = case("7b-multi-query")
    assert model.config.tie_word_embeddings
    state = {k: v for k, v in model.state_dict().items() if k.startswith(("transformer.word_embeddings.",
                                                                          "transformer.ln_f."))}
    head = FalconClientHead(model.config)
    head.load_hf_state_dict(state)  # a tied checkpoint may lack lm_head.weight
    assert head.lm_head.weight is head.word_embeddings.weight
    hidden = torch.randn(2, 5, 64)
    torch.testing.assert_close(head.logits(hidden), model.lm_head(model.transformer.ln_f(hidden)), atol=ATOL, rtol=0)


@torch.no_grad()
def test_untied_head_uses_its_own_lm_head_and_requires_it() -> None:
    model, _, head = case("40b-grouped-kv2-untied")
    assert head.lm_head.weight is not head.word_embeddings.weight
    ids = token_ids(length=4)
    torch.testing.assert_close(head.embed(ids), model.transformer.word_embeddings(ids), atol=0, rtol=0)
    hidden = torch.randn(2, 4, 64)
    torch.testing.assert_close(head.logits(hidden), model.lm_head(model.transformer.ln_f(hidden)), atol=ATOL, rtol=0)
    is_head_tensor = get_family(model.config).is_head_tensor
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" and is_head_tensor(k)}
    with pytest.raises(ValueError, match="lm_head.weight"):
        FalconClientHead(model.config).load_hf_state_dict(state)


def test_block_load_names_missing_and_unexpected_keys() -> None:
    model, _, _ = case("7b-multi-query-bias")
    state = layer0_state(model)
    state.pop("self_attention.query_key_value.bias")
    state["ln_mlp.weight"] = torch.ones(64)  # the 7B layout has one shared input_layernorm
    expected = r"missing keys \['self_attention.query_key_value.bias'\].*unexpected keys \['ln_mlp.weight'\]"
    with pytest.raises(ValueError, match=expected):
        FalconBlock(model.config, 0).load_hf_state_dict(state)


def test_block_load_rejects_a_shape_mismatch_and_modifies_nothing() -> None:
    model, _, _ = case("7b-multi-query")
    grouped_model, _, _ = case("11b-grouped-one-layernorm")  # same names, wider fused QKV (4 + 2 * 2 heads)
    state = layer0_state(model)
    state["self_attention.query_key_value.weight"] = layer0_state(grouped_model)["self_attention.query_key_value.weight"]
    block = FalconBlock(model.config, 0)
    expected = r"self_attention.query_key_value.weight has shape \(128, 64\)"
    with assert_unchanged(block), pytest.raises(ValueError, match=expected):
        block.load_hf_state_dict(state)


def test_block_rejects_a_cache_too_short_or_with_the_wrong_head_count() -> None:
    model, blocks, _ = case("7b-multi-query")
    k_cache, v_cache = make_caches(model.config, batch=1, s_max=8)[0]
    with pytest.raises(ValueError, match="exceed the cache length 8"):
        blocks[0](torch.zeros(1, 3, 64), (k_cache, v_cache), position=6)
    mha_cache = torch.zeros(1, 4, 8, 16)  # one kv head per query head: not the multi-query layout
    with pytest.raises(ValueError, match=r"k_cache has shape \(1, 4, 8, 16\)"):
        blocks[0](torch.zeros(1, 3, 64), (mha_cache, mha_cache), position=0)


@pytest.mark.parametrize("case_id", list(CASES))
def test_get_family_serves_falcon_with_its_kv_layout(case_id: str) -> None:
    config = make_config(**CASES[case_id])
    family = get_family(config)
    assert isinstance(family, ModelFamily) and family.name == "falcon"
    assert family.block_prefix(3) == "transformer.h.3."
    assert family.num_blocks(config) == 3
    assert family.kv_layout(config) == (KV_HEADS[case_id], 16)
    assert family.is_head_tensor("transformer.ln_f.bias") and family.is_head_tensor("lm_head.weight")
    assert not family.is_head_tensor("transformer.h.0.mlp.dense_h_to_4h.weight")


def test_alibi_falcon_is_rejected_with_a_clear_error() -> None:
    config = make_config(alibi=True, multi_query=False)
    with pytest.raises(ValueError, match="alibi=True .* not supported"):
        FalconBlock(config, 0)
    with pytest.raises(ValueError, match="alibi=True .* not supported"):
        FalconClientHead(config)


@pytest.mark.parametrize("overrides, message", [
    ({"new_decoder_architecture": True, "num_kv_heads": 2, "parallel_attn": False}, "parallel_attn=False"),
    ({"num_ln_in_parallel_attn": 2}, "needs new_decoder_architecture=True"),
    ({"new_decoder_architecture": True, "num_kv_heads": 3}, "not a multiple of num_kv_heads=3"),
])
def test_configs_hf_cannot_run_either_are_rejected(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FalconBlock(make_config(**overrides), 0)
