"""Pins the calling convention between corolla and the installed transformers (models/generic/adapter.py): the
decoder layer signature, the cache object and its update call, the rotary call. A transformers upgrade that
changes any of it fails here first, by name."""

from __future__ import annotations

import inspect

import pytest
import torch
from generic_cases import CASES, case_config, generic_case, one_thread  # noqa: F401
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer, Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

from corolla.models.generic.adapter import (
    BufferCacheLayer,
    LayerCallError,
    LayerSignature,
    RotaryCall,
    attention_mask_for,
    call_layer,
    make_cache,
)
from corolla.models.generic.kv import kv_access

pytestmark = pytest.mark.usefixtures("one_thread")


def test_decoder_layer_signatures_are_the_ones_the_adapter_calls() -> None:
    """transformers 5.x: keyword arguments, the cache called ``cache`` (``past_key_values`` is a deprecated alias),
    ``position_embeddings`` second in Gemma 3, no ``cache_position``."""
    gemma = list(inspect.signature(Gemma3DecoderLayer.forward).parameters)
    assert gemma == ["self", "hidden_states", "position_embeddings", "attention_mask", "position_ids", "cache", "kwargs"]
    llama = list(inspect.signature(LlamaDecoderLayer.forward).parameters)
    assert llama == ["self", "hidden_states", "attention_mask", "position_ids", "cache", "use_cache",
                     "position_embeddings", "kwargs"]
    assert LayerSignature.of(Qwen3MoeDecoderLayer) == LayerSignature(Qwen3MoeDecoderLayer, "cache", True, True)
    assert LayerSignature.of(Gemma3DecoderLayer) == LayerSignature(Gemma3DecoderLayer, "cache", True, False)


@pytest.mark.parametrize("case_id", list(CASES))
def test_every_served_layer_class_follows_the_calling_convention(case_id: str) -> None:
    _, blocks, _ = generic_case(case_id)
    signature = blocks[0].arch.signature
    assert signature.cache_parameter in ("cache", "past_key_values")
    assert "cache_position" not in inspect.signature(signature.layer_class.forward).parameters


def test_layers_that_need_more_than_hidden_states_are_refused_by_name() -> None:
    class NeedsPerLayerInput(nn.Module):
        def forward(self, hidden_states, per_layer_input, attention_mask=None, position_embeddings=None, cache=None):
            return hidden_states

    class NoCache(nn.Module):
        def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
            return hidden_states

    with pytest.raises(LayerCallError, match="requires inputs .*: per_layer_input"):
        LayerSignature.of(NeedsPerLayerInput)
    with pytest.raises(LayerCallError, match="takes no cache or past_key_values"):
        LayerSignature.of(NoCache)


def test_the_cache_routes_the_layers_update_to_our_buffers_at_its_layer_index() -> None:
    x = torch.zeros(1, 3, 8)
    k_cache, v_cache = torch.zeros(1, 2, 10, 4), torch.zeros(1, 2, 10, 4)
    access = kv_access(x, (k_cache, v_cache), 2, n_kv_heads=2, head_dim=4, window=None)
    cache = make_cache(5, access)
    assert isinstance(cache, Cache) and isinstance(cache.layers[5], BufferCacheLayer)
    assert isinstance(cache.layers[5], CacheLayerMixin)
    keys = torch.randn(1, 2, 3, 4)
    got_k, got_v = cache.update(keys, keys + 1, 5)  # what a transformers attention calls
    assert torch.equal(k_cache[:, :, 2:5], keys) and torch.equal(v_cache[:, :, 2:5], keys + 1)
    assert got_k.shape == (1, 2, 5, 4) and got_k.data_ptr() == k_cache.data_ptr()  # a view, no copy
    assert make_cache(0, kv_access(x, None, 0, n_kv_heads=2, head_dim=4, window=None)) is None


def test_call_layer_passes_keywords_and_rejects_a_wrong_output() -> None:
    seen = {}

    class Layer(nn.Module):
        def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                    position_embeddings=None, **kwargs):
            seen.update(attention_mask=attention_mask, position_ids=position_ids, cache=cache, use_cache=use_cache,
                        position_embeddings=position_embeddings, extra=kwargs)
            return hidden_states[:, :1]

    x, ids, cos_sin = torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), (torch.ones(1), torch.zeros(1))
    with pytest.raises(LayerCallError, match="expected hidden states"):
        call_layer(Layer(), LayerSignature.of(Layer), x, attention_mask=None, position_ids=ids,
                   position_embeddings=cos_sin, cache=None)
    assert seen["position_ids"] is ids and seen["use_cache"] is False and seen["extra"] == {}


def test_rotary_of_gemma3_is_called_with_the_layers_type() -> None:
    config = case_config("gemma3_text")
    local, full = RotaryCall(Gemma3RotaryEmbedding, config, "sliding_attention"), RotaryCall(
        Gemma3RotaryEmbedding, config, "full_attention")
    x, ids = torch.zeros(1, 3, 64), torch.arange(3)[None]
    cos_local, _ = local(x, ids)
    cos_full, _ = full(x, ids)
    assert cos_local.shape == (1, 3, 16) and not torch.allclose(cos_local, cos_full)  # bases 1e4 and 1e6
    with pytest.raises(LayerCallError, match="needs a layer type"):
        RotaryCall(Gemma3RotaryEmbedding, config, None)


def test_rotary_inverse_frequencies_stay_float32_when_the_block_moves_to_bfloat16() -> None:
    _, blocks, _ = generic_case("qwen3_moe")
    block = blocks[0]
    assert all(p.dtype == torch.float32 for p in block.parameters())
    assert block.rotary.module.inv_freq.dtype == torch.float32
    assert not any(m is block.rotary.module for m in block.modules())  # not in the module tree: .to() cannot cast it


def test_masks_are_bool_for_sdpa_and_additive_for_eager() -> None:
    allowed = torch.tensor([[True, False]])
    assert attention_mask_for("sdpa", allowed, torch.float32) is allowed
    eager = attention_mask_for("eager", allowed, torch.bfloat16)
    assert eager.dtype == torch.bfloat16 and eager[0, 0] == 0 and eager[0, 1] == torch.finfo(torch.bfloat16).min
    with pytest.raises(LayerCallError, match="flash_attention_2"):
        attention_mask_for("flash_attention_2", allowed, torch.float32)


def test_eager_only_models_run_eager_and_others_sdpa() -> None:
    assert generic_case("gemma2")[1][0].arch.attn_implementation == "eager"  # softcapping: transformers' choice
    assert generic_case("gpt_oss")[1][0].arch.attn_implementation == "eager"  # attention sinks
    assert generic_case("qwen3_moe")[1][0].arch.attn_implementation == "sdpa"
