"""Tiny configs of the model types the generic backend serves, and for each the HF reference with our generic blocks
and head, built once per test session.

``REQUIRED`` are the types issue 16 names, each with the features it is known for switched on at test scale
(sliding windows of 4 tokens, soft-capping, multipliers, sinks, experts); ``EXTRA`` are further types checked with
their defaults at test scale. Every case has 4 layers, hidden size 64 (4 query heads of 16, 2 KV heads), vocabulary
``VOCAB``. Our side is built from a fresh config, as a server reads it from disk (attention implementation
unset: sdpa where the model supports it); the reference runs transformers' eager attention.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator

import pytest
import torch
from reference import VOCAB, make_reference
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from corolla.models import get_family

TINY: dict[str, object] = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, num_hidden_layers=4, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
    eos_token_id=2,
)
WINDOW = 4  # every sliding-window case's window, in tokens
ALTERNATING = ["sliding_attention", "full_attention"] * 2
MOE: dict[str, object] = dict(num_experts_per_tok=2, moe_intermediate_size=32)
NORMS = ("norm.weight", "layernorm.weight")  # parameters drawn near 1 (see reference.make_reference)
ZERO_CENTERED_NORMS = ("gemma", "gemma2", "gemma3_text", "nemotron")  # norms scale by 1 + weight: weights drawn near 0

# case id -> AutoConfig.for_model kwargs on top of TINY (model_type first)
REQUIRED: dict[str, dict[str, object]] = {
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, norm_topk_prob=True, **MOE),
    "qwen3_moe-window4": dict(model_type="qwen3_moe", num_experts=4, use_sliding_window=True, sliding_window=WINDOW,
                              **MOE),
    "gemma2": dict(model_type="gemma2", sliding_window=WINDOW, layer_types=ALTERNATING, query_pre_attn_scalar=16,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(model_type="gemma3_text", sliding_window=WINDOW, layer_types=ALTERNATING,
                        query_pre_attn_scalar=16, final_logit_softcapping=30.0),  # a rotary base per layer type
    "phi3": dict(model_type="phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.5}),  # fused qkv, half rotary
    "phi3-window4": dict(model_type="phi3", sliding_window=WINDOW),
    "olmo2": dict(model_type="olmo2"),
    "granite": dict(model_type="granite", embedding_multiplier=4.0, logits_scaling=2.5, residual_multiplier=0.6,
                    attention_multiplier=0.2, tie_word_embeddings=True),
    "cohere": dict(model_type="cohere", logit_scale=0.5, use_qk_norm=True),
    "cohere2": dict(model_type="cohere2", sliding_window=WINDOW, layer_types=ALTERNATING, logit_scale=0.5),
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                    layer_types=ALTERNATING),  # attention sinks, yarn rotary, biased router
}
EXTRA: dict[str, dict[str, object]] = {
    "gemma": dict(model_type="gemma"),
    "glm": dict(model_type="glm"),
    "glm4": dict(model_type="glm4"),
    "helium": dict(model_type="helium"),
    "olmo": dict(model_type="olmo"),
    "olmo3": dict(model_type="olmo3", sliding_window=WINDOW, layer_types=ALTERNATING),
    "olmoe": dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, shared_expert_intermediate_size=48, **MOE),
    "seed_oss": dict(model_type="seed_oss"),
    "smollm3": dict(model_type="smollm3"),
    "starcoder2": dict(model_type="starcoder2"),
    "exaone4": dict(model_type="exaone4", sliding_window=WINDOW, layer_types=ALTERNATING),
    "stablelm": dict(model_type="stablelm"),
    "nemotron": dict(model_type="nemotron"),
}
CASES: dict[str, dict[str, object]] = {**REQUIRED, **EXTRA}


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models run fastest, and steadiest on a loaded machine, on one torch thread (thread pools spinning
    on busy cores cost 10x here); the previous count is restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def case_config(case_id: str) -> PretrainedConfig:
    """A fresh config of ``case_id`` (attention implementation unset, as read from disk)."""
    kwargs = dict(CASES[case_id])
    model_type = str(kwargs.pop("model_type"))
    return AutoConfig.for_model(model_type, **{**TINY, **kwargs})


@functools.cache
def generic_case(case_id: str) -> tuple[nn.Module, list[nn.Module], nn.Module]:
    """(HF reference in eval mode, our generic blocks, our head) for ``case_id``, loaded through the registry."""
    norms = () if CASES[case_id]["model_type"] in ZERO_CENTERED_NORMS else NORMS
    reference = make_reference(case_config(case_id), norms=norms)
    config = case_config(case_id)
    family = get_family(config)
    assert family.name == "generic", family.name
    state = {family.canonical_name(name): tensor for name, tensor in reference.state_dict().items()}
    blocks = [family.load_block(config, i, state).eval() for i in range(family.num_blocks(config))]
    head = family.head_class(config)
    head.load_hf_state_dict({name: tensor for name, tensor in state.items() if family.is_head_tensor(name)})
    return reference, blocks, head.eval()


def with_dtype(case_id: str, dtype: torch.dtype) -> tuple[nn.Module, list[nn.Module], nn.Module]:
    """``generic_case`` copied to ``dtype`` (the cached float32 case stays as it is)."""
    reference, blocks, head = generic_case(case_id)
    return (copy.deepcopy(reference).to(dtype), [copy.deepcopy(b).to(dtype) for b in blocks],
            copy.deepcopy(head).to(dtype))
