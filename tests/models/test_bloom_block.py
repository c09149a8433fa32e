"""What is specific to BLOOM: ALiBi slopes and their relative positions, BLOOM's gelu, incremental decoding
against HF's cache, and hub checkpoint names without the ``transformer.`` prefix.

The checks every family shares (blocks, stack, decoding, loading, head, registry) are in
``test_family_blocks.py``; the cases are in ``block_cases.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from block_cases import bloom_config, case
from reference import ATOL, make_caches, run_stack, token_ids
from safetensors.torch import save_file
from torch import Tensor
from transformers import DynamicCache
from transformers.models.bloom import modeling_bloom

from corolla.checkpoint.reader import load_tensors
from corolla.models import get_family
from corolla.models.bloom import alibi_slopes, bloom_gelu, canonical_name


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
    """ALiBi is relative: a position offset without a cache only changes rounding."""
    model, blocks, head = case(case_id)
    ids = token_ids(length=6)
    cached = run_stack(blocks, head, ids, caches=make_caches(model.config, batch=2, s_max=8))
    uncached = run_stack(blocks, head, ids, position=5)
    torch.testing.assert_close(uncached, cached, atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_heads", list(range(1, 65)) + [96, 112])
def test_alibi_slopes_equal_hf_bit_for_bit(n_heads: int) -> None:
    assert torch.equal(alibi_slopes(n_heads), modeling_bloom._get_alibi_slopes(n_heads, torch.device("cpu")))


def test_bloom_gelu_matches_hf() -> None:
    x = torch.linspace(-8, 8, 1001)
    torch.testing.assert_close(bloom_gelu(x), modeling_bloom.bloom_gelu_forward(x), atol=1e-7, rtol=0)


@pytest.mark.parametrize(("stored", "canonical"), [
    ("h.0.input_layernorm.weight", "transformer.h.0.input_layernorm.weight"),
    ("h.0.mlp.dense_h_to_4h.bias", "transformer.h.0.mlp.dense_h_to_4h.bias"),
    ("h.11.self_attention.query_key_value.bias", "transformer.h.11.self_attention.query_key_value.bias"),
    ("word_embeddings.weight", "transformer.word_embeddings.weight"),
    ("word_embeddings_layernorm.bias", "transformer.word_embeddings_layernorm.bias"),
    ("ln_f.weight", "transformer.ln_f.weight"),
    ("transformer.h.0.input_layernorm.weight", "transformer.h.0.input_layernorm.weight"),
    ("transformer.ln_f.bias", "transformer.ln_f.bias"),
    ("lm_head.weight", "lm_head.weight"),
])
def test_canonical_name_maps_hub_and_save_pretrained_names_alike(stored: str, canonical: str) -> None:
    """Both the module function and the registered family's ``canonical_name``."""
    family_canonical_name = get_family(bloom_config()).canonical_name
    for rename in (canonical_name, family_canonical_name):
        assert rename(stored) == canonical
        assert rename(canonical) == canonical


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
