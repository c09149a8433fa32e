"""What is specific to the Llama family (Llama, Mistral, Qwen2, Qwen3): rotary frequencies, dynamic rope past
the trained length, Qwen3's query/key norms, and the registry's errors.

The checks every family shares (blocks, stack, decoding, loading, head, registry) are in
``test_family_blocks.py``; the cases are in ``block_cases.py``.
"""

from __future__ import annotations

import pytest
import torch
from block_cases import case, llama_config
from reference import ATOL, load_ours, make_caches, make_reference, run_stack, token_ids
from transformers import DynamicCache
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from corolla.models import UnsupportedModelError, get_family
from corolla.models.llama import LlamaBlock, compute_inv_freq, kv_layout


@torch.no_grad()
def test_dynamic_rope_past_max_positions_matches_hf_full_and_incremental() -> None:
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = make_reference(llama_config("llama", max_position_embeddings=8, rope_parameters=rope))
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
    config = llama_config("llama", max_position_embeddings=256, head_dim=32, rope_parameters=rope)
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        hf_inv_freq, hf_scaling = type(make_reference(config).model.rotary_emb).compute_default_rope_parameters(config)
    else:
        hf_inv_freq, hf_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)
    inv_freq, scaling = compute_inv_freq(config, seq_len=seq_len)
    assert torch.equal(inv_freq, hf_inv_freq)
    assert scaling == hf_scaling


def test_qwen3_block_requires_its_query_and_key_norms() -> None:
    model, blocks, _ = case("qwen3")
    state = get_family(model.config).block_tensors(model.state_dict(), 0)
    assert {"self_attn.q_norm.weight", "self_attn.k_norm.weight"} <= set(blocks[0].state_dict())
    state.pop("self_attn.k_norm.weight")
    with pytest.raises(ValueError, match=r"missing keys \['self_attn.k_norm.weight'\], unexpected keys \[\]"):
        LlamaBlock(model.config, 0).load_hf_state_dict(state)


def test_kv_layout_uses_config_head_dim_when_set() -> None:
    assert kv_layout(llama_config("llama", head_dim=32)) == (2, 32)


def test_get_family_rejects_gpt2_and_lists_supported_types() -> None:
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*supported model types: ") as info:
        get_family(GPT2Config())
    assert isinstance(info.value, ValueError)
    listed = str(info.value).split("supported model types: ")[1].split(", ")
    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(listed) and listed == sorted(listed)
