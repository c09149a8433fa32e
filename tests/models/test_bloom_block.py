"""The BLOOM block, ALiBi slopes, client head and checkpoint naming against the Hugging Face reference.

Tiny random models are built in memory (no downloads); weights are re-drawn larger than HF's init so that
attention is far from uniform and a wrong ALiBi slope, qkv split, mask or residual shows up in the logits.
"""

from __future__ import annotations

import functools
from pathlib import Path

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
from safetensors.torch import save_file
from torch import Tensor
from transformers import BloomConfig, DynamicCache
from transformers.models.bloom import modeling_bloom

from corolla.checkpoint.reader import load_tensors
from corolla.models import ModelFamily, get_family
from corolla.models.bloom import (
    BloomBlock,
    BloomClientHead,
    alibi_slopes,
    bloom_gelu,
    canonical_name,
    is_head_tensor,
)

NORM_NAMES = ("layernorm.weight", "ln_f.weight")  # re-drawn near 1 by make_reference

# case id -> config overrides
CASES: dict[str, dict] = {
    "bloom": {},
    "bloom-6-heads": {"n_head": 6, "hidden_size": 72},  # not a power of two: the extra ALiBi slopes
    "bloom-12-heads": {"n_head": 12, "hidden_size": 96},
    "bloom-post-ln-residual": {"apply_residual_connection_post_layernorm": True},
    "bloom-untied": {"tie_word_embeddings": False},
}


def make_config(**overrides: object) -> BloomConfig:
    """A 3-layer config (4 heads, hidden 64, vocab 128)."""
    base: dict[str, object] = {
        "vocab_size": VOCAB, "hidden_size": 64, "n_head": 4, "n_layer": 3, "layer_norm_epsilon": 1e-5,
    }
    return BloomConfig(**{**base, **overrides})


@functools.cache
def case(case_id: str) -> tuple[torch.nn.Module, list[BloomBlock], BloomClientHead]:
    model = make_reference(make_config(**CASES[case_id]), norms=NORM_NAMES)
    return (model, *load_ours(model.config, model.state_dict()))


@pytest.mark.parametrize("case_id", list(CASES))
@torch.no_grad()
def test_each_block_matches_its_hf_bloom_block(case_id: str) -> None:
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
    assert_decode_steps_match_full_sequence(model, blocks, head, make_caches(model.config, batch=2, s_max=32))


@torch.no_grad()
def test_block_decode_steps_match_hf_incremental_decoding() -> None:
    model, blocks, head = case("bloom-6-heads")
    ids = token_ids(length=12)
    hf_cache, caches = DynamicCache(config=model.config), make_caches(model.config, batch=2, s_max=16)
    for start, end in [(0, 5), *[(t, t + 1) for t in range(5, 9)], (9, 12)]:
        expected = model(ids[:, start:end], past_key_values=hf_cache, use_cache=True).logits
        got = run_stack(blocks, head, ids[:, start:end], position=start, caches=caches)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=lambda m: f"tokens [{start}, {end}): {m}")


@pytest.mark.parametrize("case_id", ["bloom", "bloom-6-heads"])
@torch.no_grad()
def test_block_without_cache_at_a_later_position_equals_the_cached_result(case_id: str) -> None:
    model, blocks, head = case(case_id)
    ids = token_ids(length=6)
    cached = run_stack(blocks, head, ids, caches=make_caches(model.config, batch=2, s_max=8))
    uncached = run_stack(blocks, head, ids, position=5)  # ALiBi is relative: the offset only changes rounding
    torch.testing.assert_close(uncached, cached, atol=ATOL, rtol=0)
    torch.testing.assert_close(uncached, model(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_heads", list(range(1, 65)) + [96, 112])
def test_alibi_slopes_equal_hf_bit_for_bit(n_heads: int) -> None:
    assert torch.equal(alibi_slopes(n_heads), modeling_bloom._get_alibi_slopes(n_heads, torch.device("cpu")))


def test_bloom_gelu_matches_hf() -> None:
    x = torch.linspace(-8, 8, 1001)
    torch.testing.assert_close(bloom_gelu(x), modeling_bloom.bloom_gelu_forward(x), atol=1e-7, rtol=0)


@torch.no_grad()
def test_block_runs_in_bfloat16_close_to_hf_bfloat16() -> None:
    model, _, _ = case("bloom-6-heads")
    model_bf16 = make_reference(model.config, norms=NORM_NAMES).to(torch.bfloat16)
    assert_bfloat16_close_to_hf(model_bf16, chunks=[(0, 8), (8, 9), (9, 10), (10, 15)])


@torch.no_grad()
def test_head_ties_lm_head_to_embeddings_by_default() -> None:
    model, _, _ = case("bloom")
    assert model.config.tie_word_embeddings
    state = {k: v for k, v in model.state_dict().items() if is_head_tensor(k) and k != "lm_head.weight"}
    head = BloomClientHead(model.config)
    head.load_hf_state_dict(state)  # a tied checkpoint has no lm_head.weight
    assert head.lm_head.weight is head.word_embeddings.weight
    ids = token_ids(length=4)
    expected_embed = model.transformer.word_embeddings_layernorm(model.transformer.word_embeddings(ids))
    torch.testing.assert_close(head.embed(ids), expected_embed, atol=0, rtol=0)
    hidden = torch.randn(2, 5, 64)
    torch.testing.assert_close(head.logits(hidden), model.lm_head(model.transformer.ln_f(hidden)), atol=ATOL, rtol=0)


@torch.no_grad()
def test_tied_head_ignores_a_stored_lm_head() -> None:
    model, _, _ = case("bloom")
    state = {k: v for k, v in model.state_dict().items() if is_head_tensor(k)}
    state["lm_head.weight"] = torch.zeros(VOCAB, 64)
    head = BloomClientHead(model.config)
    head.load_hf_state_dict(state)
    torch.testing.assert_close(head.lm_head.weight, model.transformer.word_embeddings.weight, atol=0, rtol=0)


@torch.no_grad()
def test_untied_head_uses_its_own_lm_head_and_requires_it() -> None:
    model, _, head = case("bloom-untied")
    assert head.lm_head.weight is not head.word_embeddings.weight
    assert not torch.equal(head.lm_head.weight, head.word_embeddings.weight)
    hidden = torch.randn(2, 4, 64)
    torch.testing.assert_close(head.logits(hidden), model.lm_head(model.transformer.ln_f(hidden)), atol=ATOL, rtol=0)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" and is_head_tensor(k)}
    with pytest.raises(ValueError, match="lm_head.weight"):
        BloomClientHead(model.config).load_hf_state_dict(state)


def test_head_casts_hidden_states_to_its_dtype() -> None:
    _, _, head = case("bloom")
    logits = head.logits(torch.randn(1, 2, 64, dtype=torch.bfloat16))
    assert logits.dtype == torch.float32


@pytest.mark.parametrize(("stored", "canonical"), [
    ("h.0.input_layernorm.weight", "transformer.h.0.input_layernorm.weight"),
    ("h.11.self_attention.query_key_value.bias", "transformer.h.11.self_attention.query_key_value.bias"),
    ("word_embeddings.weight", "transformer.word_embeddings.weight"),
    ("word_embeddings_layernorm.bias", "transformer.word_embeddings_layernorm.bias"),
    ("ln_f.weight", "transformer.ln_f.weight"),
    ("transformer.h.0.input_layernorm.weight", "transformer.h.0.input_layernorm.weight"),
    ("transformer.ln_f.bias", "transformer.ln_f.bias"),
    ("lm_head.weight", "lm_head.weight"),
])
def test_canonical_name_maps_hub_and_save_pretrained_names_alike(stored: str, canonical: str) -> None:
    assert canonical_name(stored) == canonical
    assert canonical_name(canonical) == canonical


@torch.no_grad()
def test_checkpoint_stored_without_transformer_prefix_loads_through_the_family(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COROLLA_CACHE", str(tmp_path / "cache"))
    model, _, _ = case("bloom")
    family = get_family(model.config)
    # hub style (as bigscience/bloom-560m): no "transformer." prefix and, tied, no lm_head.weight
    hub_state = {k.removeprefix("transformer."): v.contiguous() for k, v in model.state_dict().items()
                 if k != "lm_head.weight"}
    assert "h.1.mlp.dense_4h_to_h.weight" in hub_state
    save_file(hub_state, str(tmp_path / "model.safetensors"))
    prefix = family.block_prefix(1)
    block = family.load_block(
        model.config, 1, load_tensors(str(tmp_path), lambda name: name.startswith(prefix), rename=family.canonical_name)
    )
    head_state = load_tensors(str(tmp_path), family.is_head_tensor, rename=family.canonical_name)
    head = family.head_class(model.config)
    head.load_hf_state_dict(head_state)
    hidden = torch.randn(1, 3, 64)
    torch.testing.assert_close(block(hidden), model.transformer.h[1](hidden, alibi=_hf_alibi(model, 1, 3),
                                                                        attention_mask=_hf_causal(3))[0],
                               atol=ATOL, rtol=0)
    ids = token_ids(length=3)
    torch.testing.assert_close(head.embed(ids), model.transformer.word_embeddings_layernorm(
        model.transformer.word_embeddings(ids)), atol=0, rtol=0)


def _hf_alibi(model: torch.nn.Module, batch: int, length: int) -> Tensor:
    """HF's alibi tensor (batch * n_heads, 1, length) for unpadded inputs."""
    return modeling_bloom.build_alibi_tensor(torch.ones(batch, length), model.config.n_head, torch.float32)


def _hf_causal(length: int) -> Tensor:
    """An additive (1, 1, length, length) causal mask as HF's eager attention takes it."""
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    return torch.zeros(length, length).masked_fill(future, torch.finfo(torch.float32).min)[None, None]


def test_block_load_names_missing_and_unexpected_keys_and_modifies_nothing() -> None:
    model, _, _ = case("bloom")
    state = get_family(model.config).block_tensors(model.state_dict(), 0)
    state.pop("self_attention.dense.bias")
    state["self_attention.rotary_emb.inv_freq"] = torch.zeros(8)
    block = BloomBlock(model.config, 0)
    expected = r"missing keys \['self_attention.dense.bias'\].*unexpected keys \['self_attention.rotary_emb.inv_freq'\]"
    with assert_unchanged(block), pytest.raises(ValueError, match=expected):
        block.load_hf_state_dict(state)


def test_block_load_names_a_shape_mismatch_and_modifies_nothing() -> None:
    model, _, _ = case("bloom")
    state = get_family(model.config).block_tensors(model.state_dict(), 0)
    state["self_attention.query_key_value.weight"] = torch.zeros(3 * 64, 32)
    block = BloomBlock(model.config, 0)
    expected = r"self_attention.query_key_value.weight has shape \(192, 32\)"
    with assert_unchanged(block), pytest.raises(ValueError, match=expected):
        block.load_hf_state_dict(state)


def test_head_load_names_missing_and_unexpected_keys() -> None:
    model, _, _ = case("bloom")
    state = {k: v for k, v in model.state_dict().items() if is_head_tensor(k)}
    state.pop("transformer.word_embeddings_layernorm.bias")
    state["word_embeddings.weight"] = torch.zeros(VOCAB, 64)  # not canonical
    expected = (r"missing keys \['transformer.word_embeddings_layernorm.bias'\]"
                r".*unexpected keys \['word_embeddings.weight'\]")
    with pytest.raises(ValueError, match=expected):
        BloomClientHead(model.config).load_hf_state_dict(state)


def test_block_rejects_caches_that_do_not_fit() -> None:
    model, blocks, _ = case("bloom")
    k_cache, v_cache = make_caches(model.config, batch=1, s_max=8)[0]
    x = torch.zeros(1, 3, 64)
    with pytest.raises(ValueError, match="exceed the cache length 8"):
        blocks[0](x, (k_cache, v_cache), position=6)
    with pytest.raises(ValueError, match="k_cache has shape"):
        blocks[0](x, (torch.zeros(1, 2, 8, 16), v_cache))
    with pytest.raises(ValueError, match="v_cache dtype"):
        blocks[0](x, (k_cache, v_cache.bfloat16()))
    with pytest.raises(ValueError, match="position must be >= 0"):
        blocks[0](x, position=-1)


def test_get_family_serves_bloom() -> None:
    config = make_config(n_head=6, hidden_size=72)
    family = get_family(config)
    assert isinstance(family, ModelFamily) and family.name == "bloom"
    assert family.block_class is BloomBlock and family.head_class is BloomClientHead
    assert family.block_prefix(3) == "transformer.h.3."
    assert family.num_blocks(config) == 3
    assert family.kv_layout(config) == (6, 12)
    assert family.canonical_name("h.0.mlp.dense_h_to_4h.bias") == "transformer.h.0.mlp.dense_h_to_4h.bias"
    assert family.is_head_tensor("transformer.ln_f.weight") and family.is_head_tensor("lm_head.weight")
    assert not family.is_head_tensor("transformer.h.0.input_layernorm.weight")
    assert not family.is_head_tensor("ln_f.weight")  # head names are canonical
