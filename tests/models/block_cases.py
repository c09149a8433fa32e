"""The tiny configs the block tests run on: one named case per family variant, and for each case the HF
reference model with our blocks and head, built once per test session.

Every case is a 3-layer model over ``VOCAB`` tokens with hidden size 64 (so ``token_ids`` fit). Case ids are
unique across families, so the family-generic tests (``test_family_blocks.py``) and the family-specific
tests (``test_<family>_block.py``) share one cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import partial

from reference import VOCAB, load_ours, make_family_reference
from torch import nn
from transformers import (
    BloomConfig,
    FalconConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

LLAMA_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
}
MIXTRAL_EXPERTS = 4
MIXTRAL_INNER = 48  # each expert's intermediate size


def llama_config(model_type: str = "llama", **overrides: object) -> PretrainedConfig:
    """A 3-layer GQA config (4 query heads, 2 kv heads, hidden 64, head_dim 16) of a Llama-family model type."""
    base: dict[str, object] = {
        "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 3, "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
    }
    if model_type == "qwen3":
        base["head_dim"] = 16  # Qwen3Config defaults head_dim to 128 instead of hidden_size / num_attention_heads
    return LLAMA_CONFIG_CLASSES[model_type](**{**base, **overrides})


def bloom_config(**overrides: object) -> BloomConfig:
    """A 3-layer BLOOM config (4 heads, hidden 64); embeddings tied, as BLOOM's default."""
    base: dict[str, object] = {
        "vocab_size": VOCAB, "hidden_size": 64, "n_head": 4, "n_layer": 3, "layer_norm_epsilon": 1e-5,
    }
    return BloomConfig(**{**base, **overrides})


def falcon_config(**overrides: object) -> FalconConfig:
    """A 3-layer Falcon-7B-style config (4 query heads of 16, multi-query, parallel attention, hidden 64)."""
    base: dict[str, object] = {
        "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "num_hidden_layers": 3,
        "vocab_size": VOCAB, "max_position_embeddings": 64, "layer_norm_epsilon": 1e-5,
    }
    return FalconConfig(**{**base, **overrides})


def mixtral_config(**overrides: object) -> MixtralConfig:
    """A 3-layer GQA Mixtral (4 query heads, 2 kv heads, hidden 64, 4 experts of 48, top-2)."""
    base: dict[str, object] = {
        "hidden_size": 64, "intermediate_size": MIXTRAL_INNER, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 3, "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "num_local_experts": MIXTRAL_EXPERTS, "num_experts_per_tok": 2,
    }
    return MixtralConfig(**{**base, **overrides})


# case id -> config factory
CASES: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": partial(llama_config, "llama"),
    "llama-tied": partial(llama_config, "llama", tie_word_embeddings=True),
    "llama-biases-head_dim32": partial(llama_config, "llama", attention_bias=True, mlp_bias=True, head_dim=32),
    "mistral": partial(llama_config, "mistral"),
    "mistral-window4": partial(llama_config, "mistral", sliding_window=4),
    "qwen2": partial(llama_config, "qwen2"),
    "qwen2-window4-from-layer1": partial(llama_config, "qwen2", use_sliding_window=True, sliding_window=4,
                                         max_window_layers=1),
    "qwen3": partial(llama_config, "qwen3"),
    "qwen3-biases-head_dim32": partial(llama_config, "qwen3", attention_bias=True, head_dim=32),
    "qwen3-window4-from-layer1": partial(llama_config, "qwen3", use_sliding_window=True, sliding_window=4,
                                         max_window_layers=1),
    "llama-rope-linear": partial(llama_config, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 10000.0}),
    "llama-rope-dynamic": partial(llama_config, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                 "rope_theta": 10000.0}),
    "llama-rope-llama3": partial(llama_config, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 10000.0}),
    "llama-rope-yarn": partial(llama_config, max_position_embeddings=1024, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0}),
    "bloom": bloom_config,
    "bloom-6-heads": partial(bloom_config, n_head=6, hidden_size=72),  # not a power of two: the extra ALiBi slopes
    "bloom-12-heads": partial(bloom_config, n_head=12, hidden_size=96),
    "bloom-post-ln-residual": partial(bloom_config, apply_residual_connection_post_layernorm=True),
    "bloom-untied": partial(bloom_config, tie_word_embeddings=False),
    "falcon-7b-multi-query": falcon_config,
    "falcon-7b-multi-query-bias": partial(falcon_config, bias=True),
    "falcon-40b-grouped-kv2-untied": partial(falcon_config, new_decoder_architecture=True, num_kv_heads=2,
                                             tie_word_embeddings=False),
    "falcon-11b-grouped-one-layernorm": partial(falcon_config, new_decoder_architecture=True, num_kv_heads=2,
                                                num_ln_in_parallel_attn=1),
    "falcon-mha-sequential-bias": partial(falcon_config, multi_query=False, parallel_attn=False, bias=True),
    "falcon-mha-parallel": partial(falcon_config, multi_query=False),
    "falcon-rope-linear-theta500": partial(falcon_config, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                           "rope_theta": 500.0}),
    "mixtral-4experts-top2": mixtral_config,
    "mixtral-4experts-top1": partial(mixtral_config, num_experts_per_tok=1),
    "mixtral-4experts-top2-window4": partial(mixtral_config, sliding_window=4),
}


@functools.cache
def case(case_id: str) -> tuple[nn.Module, list[nn.Module], nn.Module]:
    """The HF reference model of ``CASES[case_id]``, with our blocks and head loaded from its state dict."""
    model = make_family_reference(CASES[case_id]())
    return (model, *load_ours(model.config, model.state_dict()))
