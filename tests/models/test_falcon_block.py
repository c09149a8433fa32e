"""The Falcon block and client head against the Hugging Face reference.

Tiny random models are built in memory (no downloads); weights are re-drawn larger than HF's init so that
attention is far from uniform and a wrong QKV split, rotary, mask or bias shows up in the logits.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, FalconConfig

from corolla.models import ModelFamily, get_family
from corolla.models.falcon import FalconBlock, FalconClientHead, kv_layout

ATOL = 1e-5
VOCAB = 128
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


def make_reference(config: FalconConfig, seed: int = 0) -> torch.nn.Module:
    """HF model with eager attention, eval mode, float32, weights N(0, 0.1) and norm weights near 1."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(NORM_NAMES):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
    return model


def load_ours(model: torch.nn.Module) -> tuple[list[FalconBlock], FalconClientHead]:
    """Our blocks and head, loaded from the HF model's checkpoint names through the registry."""
    config = model.config
    family = get_family(config)
    state = model.state_dict()
    blocks = []
    for i in range(family.num_blocks(config)):
        prefix = family.block_prefix(i)
        block = family.block_class(config, i)
        block.load_hf_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        blocks.append(block.eval())
    head = family.head_class(config)
    head.load_hf_state_dict({k: v for k, v in state.items() if family.is_head_tensor(k)})
    return blocks, head.eval()


@functools.cache
def case(case_id: str) -> tuple[torch.nn.Module, list[FalconBlock], FalconClientHead]:
    model = make_reference(make_config(**CASES[case_id]))
    return (model, *load_ours(model))


def token_ids(batch: int = 2, length: int = 15, seed: int = 1) -> Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def make_cache(config: FalconConfig, batch: int, s_max: int) -> list[tuple[Tensor, Tensor]]:
    n_kv_heads, head_dim = kv_layout(config)
    return [(torch.zeros(batch, n_kv_heads, s_max, head_dim), torch.zeros(batch, n_kv_heads, s_max, head_dim))
            for _ in range(config.num_hidden_layers)]


def run_stack(blocks: list[FalconBlock], head: FalconClientHead, ids: Tensor, *, position: int = 0,
              caches: list[tuple[Tensor, Tensor]] | None = None) -> Tensor:
    hidden = head.embed(ids)
    for i, block in enumerate(blocks):
        hidden = block(hidden, caches[i] if caches is not None else None, position)
    return head.logits(hidden)


def block_state(model: torch.nn.Module, index: int = 0) -> dict[str, Tensor]:
    prefix = f"transformer.h.{index}."
    return {k[len(prefix):]: v for k, v in model.state_dict().items() if k.startswith(prefix)}


@pytest.mark.parametrize("case_id", list(CASES))
@torch.no_grad()
def test_each_block_matches_its_hf_decoder_layer(case_id: str) -> None:
    model, blocks, head = case(case_id)
    layer_outputs: list[Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _a, out: layer_outputs.append(out[0]))
             for layer in model.transformer.h]
    ids = token_ids()
    model(ids)
    for hook in hooks:
        hook.remove()
    inputs = [head.embed(ids), *layer_outputs[:-1]]
    for i, block in enumerate(blocks):
        torch.testing.assert_close(block(inputs[i]), layer_outputs[i], atol=ATOL, rtol=0, msg=f"layer {i}")


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
    ids = token_ids(length=15)
    expected = model(ids).logits  # (B, 15, V)
    caches = make_cache(model.config, batch=2, s_max=32)
    assert caches[0][0].shape == (2, KV_HEADS[case_id], 32, 16)
    chunks = [(0, 7), *[(t, t + 1) for t in range(7, 12)], (12, 15)]  # prefill 7, five single steps, a 3-token chunk
    for start, end in chunks:
        got = run_stack(blocks, head, ids[:, start:end], position=start, caches=caches)
        torch.testing.assert_close(got, expected[:, start:end], atol=ATOL, rtol=0, msg=f"tokens [{start}, {end})")


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
    model_bf16 = make_reference(model.config).to(torch.bfloat16)
    blocks, head = load_ours(model_bf16)
    blocks, head = [b.to(torch.bfloat16) for b in blocks], head.to(torch.bfloat16)
    ids = token_ids()
    got = run_stack(blocks, head, ids)
    assert got.dtype == torch.bfloat16
    caches = [(k.bfloat16(), v.bfloat16()) for k, v in make_cache(model.config, batch=2, s_max=16)]
    stepped = torch.cat([run_stack(blocks, head, ids[:, :8], caches=caches),
                         run_stack(blocks, head, ids[:, 8:], position=8, caches=caches)], dim=1)
    expected = model_bf16(ids).logits.float()
    torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=0.05)
    torch.testing.assert_close(stepped.float(), expected, atol=0.1, rtol=0.05)


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
    state = block_state(model)
    state.pop("self_attention.query_key_value.bias")
    state["ln_mlp.weight"] = torch.ones(64)  # the 7B layout has one shared input_layernorm
    expected = r"missing keys \['self_attention.query_key_value.bias'\].*unexpected keys \['ln_mlp.weight'\]"
    with pytest.raises(ValueError, match=expected):
        FalconBlock(model.config, 0).load_hf_state_dict(state)


def test_block_load_rejects_a_shape_mismatch_and_modifies_nothing() -> None:
    model, _, _ = case("7b-multi-query")
    grouped_model, _, _ = case("11b-grouped-one-layernorm")  # same names, wider fused QKV (4 + 2 * 2 heads)
    state = block_state(model)
    state["self_attention.query_key_value.weight"] = block_state(grouped_model)["self_attention.query_key_value.weight"]
    block = FalconBlock(model.config, 0)
    before = {k: v.clone() for k, v in block.state_dict().items()}
    with pytest.raises(ValueError, match=r"self_attention.query_key_value.weight has shape \(128, 64\)"):
        block.load_hf_state_dict(state)
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items())


def test_block_rejects_a_cache_too_short_or_with_the_wrong_head_count() -> None:
    model, blocks, _ = case("7b-multi-query")
    k_cache, v_cache = make_cache(model.config, batch=1, s_max=8)[0]
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
