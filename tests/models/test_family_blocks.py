"""What every model family's blocks and client head must do, checked against the Hugging Face reference.

Each test is parametrized over the cases of ``block_cases.CASES`` it applies to; where the HF model keeps its
layers, norms and embeddings comes from the family's ``FamilyAdapter``. Tiny random models are built in memory
(no downloads), weights re-drawn larger than HF's init so that a wrong rotary, ALiBi slope, mask, bias or
QKV split shows up in the logits. The family-specific checks stay in ``test_<family>_block.py``.
"""

from __future__ import annotations

import re

import pytest
import torch
from block_cases import CASES, case
from reference import (
    ATOL,
    VOCAB,
    assert_bfloat16_close_to_hf,
    assert_blocks_match_hf_layers,
    assert_decode_steps_match_full_sequence,
    assert_unchanged,
    family_adapter,
    make_caches,
    make_family_reference,
    run_stack,
    token_ids,
)

from corolla.models import ModelFamily, get_family
from corolla.models.bloom import BloomBlock, BloomClientHead
from corolla.models.falcon import FalconBlock, FalconClientHead
from corolla.models.llama import LlamaBlock, LlamaClientHead
from corolla.models.mixtral import MixtralBlock

ONE_PER_FAMILY = ["llama", "bloom", "falcon-7b-multi-query", "mixtral-4experts-top2"]
TIED = ["llama-tied", "bloom", "falcon-7b-multi-query"]  # bloom and falcon tie by default
UNTIED = ["llama", "bloom-untied", "falcon-40b-grouped-kv2-untied", "mixtral-4experts-top2"]


# ---- blocks and stack against HF ---------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", list(CASES))
@torch.no_grad()
def test_each_block_matches_its_hf_layer(case_id: str) -> None:
    model, blocks, head = case(case_id)
    assert_blocks_match_hf_layers(model, family_adapter(model.config).hf_layers(model), blocks, head)


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


@pytest.mark.parametrize("case_id", [
    "llama", "mistral-window4", "llama-rope-yarn", "qwen3", "bloom", "bloom-6-heads", "falcon-7b-multi-query",
    "falcon-40b-grouped-kv2-untied", "falcon-mha-sequential-bias", "mixtral-4experts-top2-window4",
])
@torch.no_grad()
def test_block_without_cache_at_a_later_position_matches_hf_there(case_id: str) -> None:
    """Without a cache, ``position`` offsets the positions: rotary starts there; ALiBi, relative, is unchanged."""
    model, blocks, head = case(case_id)
    ids = token_ids(length=6)
    expected = family_adapter(model.config).hf_logits_at(model, ids, position=5)
    torch.testing.assert_close(run_stack(blocks, head, ids, position=5), expected, atol=ATOL, rtol=0)


DEFAULT_CHUNKS = ((0, 8), (8, 15))
BFLOAT16_CHUNKS: dict[str, tuple[tuple[int, int], ...]] = {  # case id -> how the 15 tokens are fed through caches
    "llama": DEFAULT_CHUNKS,
    "qwen2": DEFAULT_CHUNKS,
    "qwen3": DEFAULT_CHUNKS,
    "bloom-6-heads": ((0, 8), (8, 9), (9, 10), (10, 15)),
    "falcon-40b-grouped-kv2-untied": DEFAULT_CHUNKS,
    "mixtral-4experts-top2": DEFAULT_CHUNKS,
}


@pytest.mark.parametrize("case_id", list(BFLOAT16_CHUNKS))
@torch.no_grad()
def test_block_runs_in_bfloat16_close_to_hf_bfloat16(case_id: str) -> None:
    model, _, _ = case(case_id)
    assert_bfloat16_close_to_hf(make_family_reference(model.config).to(torch.bfloat16), BFLOAT16_CHUNKS[case_id])


# ---- block loading and cache validation -------------------------------------------------------------------


@pytest.mark.parametrize(("case_id", "missing", "unexpected"), [
    ("qwen2", "self_attn.q_proj.bias", "self_attn.o_proj.bias"),  # Qwen2 has no o_proj bias
    ("bloom", "self_attention.dense.bias", "self_attention.rotary_emb.inv_freq"),  # BLOOM has no rotary
    # the 7B layout has one shared input_layernorm
    ("falcon-7b-multi-query-bias", "self_attention.query_key_value.bias", "ln_mlp.weight"),
])
def test_block_load_names_missing_and_unexpected_keys_and_modifies_nothing(
    case_id: str, missing: str, unexpected: str
) -> None:
    model, _, _ = case(case_id)
    family = get_family(model.config)
    state = family.block_tensors(model.state_dict(), 0)
    state.pop(missing)
    state[unexpected] = torch.zeros(64)
    block = family.block_class(model.config, 0)
    expected = rf"missing keys \['{re.escape(missing)}'\].*unexpected keys \['{re.escape(unexpected)}'\]"
    with assert_unchanged(block), pytest.raises(ValueError, match=expected):
        block.load_hf_state_dict(state)


@pytest.mark.parametrize(("case_id", "name", "shape"), [
    ("llama", "self_attn.k_proj.weight", (64, 64)),  # one kv head per query head: not the GQA layout
    ("bloom", "self_attention.query_key_value.weight", (192, 32)),
    ("falcon-7b-multi-query", "self_attention.query_key_value.weight", (128, 64)),  # 11B's grouped QKV (4 + 2 * 2)
])
def test_block_load_names_a_shape_mismatch_and_modifies_nothing(case_id: str, name: str,
                                                                shape: tuple[int, int]) -> None:
    model, _, _ = case(case_id)
    family = get_family(model.config)
    state = family.block_tensors(model.state_dict(), 0)
    state[name] = torch.zeros(shape)
    block = family.block_class(model.config, 0)
    with assert_unchanged(block), pytest.raises(ValueError, match=re.escape(f"{name} has shape {shape}")):
        block.load_hf_state_dict(state)


@pytest.mark.parametrize(("case_id", "wrong_kv_heads"), [
    ("llama", 4), ("bloom", 2), ("falcon-7b-multi-query", 4), ("mixtral-4experts-top2", 4),  # right: 2, 4, 1, 2
])
def test_block_rejects_caches_that_do_not_fit(case_id: str, wrong_kv_heads: int) -> None:
    """Too short for the positions, the wrong kv head count, the wrong dtype, a negative position."""
    model, blocks, _ = case(case_id)
    k_cache, v_cache = make_caches(model.config, batch=1, s_max=8)[0]
    x = torch.zeros(1, 3, 64)
    with pytest.raises(ValueError, match="exceed the cache length 8"):
        blocks[0](x, (k_cache, v_cache), position=6)
    wrong = torch.zeros(1, wrong_kv_heads, 8, 16)
    with pytest.raises(ValueError, match=re.escape(f"k_cache has shape (1, {wrong_kv_heads}, 8, 16)")):
        blocks[0](x, (wrong, wrong), position=0)
    with pytest.raises(ValueError, match="v_cache dtype"):
        blocks[0](x, (k_cache, v_cache.bfloat16()))
    with pytest.raises(ValueError, match="position must be >= 0"):
        blocks[0](x, position=-1)


# ---- client head --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", TIED)
@torch.no_grad()
def test_tied_head_shares_the_embeddings_and_loads_without_lm_head(case_id: str) -> None:
    model, _, _ = case(case_id)
    adapter, family = family_adapter(model.config), get_family(model.config)
    assert model.config.tie_word_embeddings
    state = {k: v for k, v in model.state_dict().items() if family.is_head_tensor(k) and k != "lm_head.weight"}
    head = family.head_class(model.config)
    head.load_hf_state_dict(state)  # a tied checkpoint may lack lm_head.weight
    assert head.lm_head.weight is getattr(head, adapter.head_embedding).weight
    ids = token_ids(length=4)
    torch.testing.assert_close(head.embed(ids), adapter.hf_embed(model, ids), atol=0, rtol=0)
    hidden = torch.randn(2, 5, 64)
    torch.testing.assert_close(head.logits(hidden), adapter.hf_logits(model, hidden), atol=ATOL, rtol=0)


@pytest.mark.parametrize("case_id", TIED)
@torch.no_grad()
def test_tied_head_ignores_a_stored_lm_head(case_id: str) -> None:
    model, _, _ = case(case_id)
    family = get_family(model.config)
    state = {k: v for k, v in model.state_dict().items() if family.is_head_tensor(k)}
    state["lm_head.weight"] = torch.zeros(VOCAB, 64)
    head = family.head_class(model.config)
    head.load_hf_state_dict(state)
    torch.testing.assert_close(head.lm_head.weight, model.get_input_embeddings().weight, atol=0, rtol=0)


@pytest.mark.parametrize("case_id", UNTIED)
@torch.no_grad()
def test_untied_head_uses_its_own_lm_head_and_requires_it(case_id: str) -> None:
    model, _, head = case(case_id)
    adapter, family = family_adapter(model.config), get_family(model.config)
    embedding = getattr(head, adapter.head_embedding).weight
    assert head.lm_head.weight is not embedding and not torch.equal(head.lm_head.weight, embedding)
    ids = token_ids(length=4)
    torch.testing.assert_close(head.embed(ids), adapter.hf_embed(model, ids), atol=0, rtol=0)
    hidden = torch.randn(2, 4, 64)
    torch.testing.assert_close(head.logits(hidden), adapter.hf_logits(model, hidden), atol=ATOL, rtol=0)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" and family.is_head_tensor(k)}
    with pytest.raises(ValueError, match="lm_head.weight"):
        family.head_class(model.config).load_hf_state_dict(state)


@pytest.mark.parametrize(("case_id", "missing", "unexpected"), [
    ("llama", "model.norm.weight", "embed_tokens.weight"),
    ("bloom", "transformer.word_embeddings_layernorm.bias", "word_embeddings.weight"),
    ("falcon-7b-multi-query", "transformer.ln_f.bias", "word_embeddings.weight"),
])
def test_head_load_names_missing_and_unexpected_keys(case_id: str, missing: str, unexpected: str) -> None:
    """A missing tensor and a non-canonical name are both named, and the head is left as it was."""
    model, _, _ = case(case_id)
    family = get_family(model.config)
    state = {k: v for k, v in model.state_dict().items() if family.is_head_tensor(k)}
    state.pop(missing)
    state[unexpected] = torch.zeros(VOCAB, 64)
    head = family.head_class(model.config)
    expected = rf"missing keys \['{re.escape(missing)}'\].*unexpected keys \['{re.escape(unexpected)}'\]"
    with assert_unchanged(head), pytest.raises(ValueError, match=expected):
        head.load_hf_state_dict(state)


@pytest.mark.parametrize("case_id", ONE_PER_FAMILY)
def test_head_casts_hidden_states_to_its_dtype(case_id: str) -> None:
    _, _, head = case(case_id)
    logits = head.logits(torch.randn(1, 2, 64, dtype=torch.bfloat16))
    assert logits.dtype == torch.float32


# ---- registry -----------------------------------------------------------------------------------------------

FAMILY_CLASSES = {  # family name -> (block class, head class)
    "llama": (LlamaBlock, LlamaClientHead), "bloom": (BloomBlock, BloomClientHead),
    "falcon": (FalconBlock, FalconClientHead), "mixtral": (MixtralBlock, LlamaClientHead),  # Llama's head
}
# case id -> (family name, kv_layout = (n_kv_heads, head_dim))
SERVED_BY: dict[str, tuple[str, tuple[int, int]]] = {
    "llama": ("llama", (2, 16)), "mistral": ("llama", (2, 16)), "qwen2": ("llama", (2, 16)),
    "qwen3": ("llama", (2, 16)),
    "bloom-6-heads": ("bloom", (6, 12)),
    "falcon-7b-multi-query": ("falcon", (1, 16)), "falcon-7b-multi-query-bias": ("falcon", (1, 16)),
    "falcon-40b-grouped-kv2-untied": ("falcon", (2, 16)), "falcon-11b-grouped-one-layernorm": ("falcon", (2, 16)),
    "falcon-mha-sequential-bias": ("falcon", (4, 16)), "falcon-mha-parallel": ("falcon", (4, 16)),
    "falcon-rope-linear-theta500": ("falcon", (1, 16)),
    "mixtral-4experts-top2": ("mixtral", (2, 16)),
}


@pytest.mark.parametrize("case_id", list(SERVED_BY))
def test_get_family_serves_the_family_with_its_kv_layout(case_id: str) -> None:
    """The registry picks the family, its classes, block names and kv layout; the head takes exactly the
    HF tensors outside the decoder layers."""
    model, _, _ = case(case_id)
    config, adapter = model.config, family_adapter(model.config)
    name, layout = SERVED_BY[case_id]
    family = get_family(config)
    assert isinstance(family, ModelFamily) and family.name == name
    assert (family.block_class, family.head_class) == FAMILY_CLASSES[name]
    assert family.block_prefix(3) == f"{adapter.layers}.3."
    assert family.num_blocks(config) == 3
    assert family.kv_layout(config) == layout
    assert make_caches(config, batch=2, s_max=32)[0][0].shape == (2, layout[0], 32, layout[1])
    state = model.state_dict()
    assert "lm_head.weight" in state
    assert {k for k in state if family.is_head_tensor(k)} == {k for k in state if not k.startswith(adapter.layers)}
    assert not any(family.is_head_tensor(k) for k in adapter.not_head_tensors)
