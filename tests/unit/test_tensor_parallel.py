"""Tensor-parallel blocks (shards on several devices, partials summed) against the unsharded block.

Families: the Llama family and Mixtral, BLOOM (ALiBi slopes of the full model per shard, post-LN residuals) and
Falcon (multi-query with a copied KV head, grouped new-architecture KV heads, biases, sequential layout).

The unsharded block is itself checked against HF in tests/models; here every sharded path must give its outputs
within 1e-5 (float32): a cache-less forward, a prefill then single-token cached steps (caches compared too),
and batched decode over several sessions through `BlockStack.decode_batch` of a `tensor_parallel_stack` (the RaggedKV path).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
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

from corolla.models import get_family
from corolla.models.llama.sharding import split_evenly
from corolla.server.compute.block_stack import BlockStack, KVLayout
from corolla.models.quantization import quantize_block, quantized_linear_count, resident_bytes
from corolla.server.compute.tensor_parallel import (
    build_tensor_parallel_block,
    check_tensor_parallel,
    measure_throughput,
    tensor_parallel_stack,
)

ATOL = 1e-5
BASE = dict(hidden_size=96, intermediate_size=100, num_attention_heads=12, num_key_value_heads=6, head_dim=8,
            num_hidden_layers=2, vocab_size=64, max_position_embeddings=64, rms_norm_eps=1e-6)

BLOOM_BASE = dict(hidden_size=64, n_head=8, n_layer=2, vocab_size=64)
FALCON_BASE = dict(hidden_size=96, num_attention_heads=12, num_hidden_layers=2, vocab_size=64, ffn_hidden_size=100,
                   max_position_embeddings=64, parallel_attn=True, bias=False)
FALCON_7B = dict(multi_query=True, new_decoder_architecture=False)  # one KV head, one input_layernorm
FALCON_40B = dict(new_decoder_architecture=True, num_kv_heads=4)  # ln_attn / ln_mlp, 3 query heads per KV head

# case id -> (config class, config kwargs)
CASES: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "llama-gqa": (LlamaConfig, BASE),
    "llama-biases": (LlamaConfig, {**BASE, "attention_bias": True, "mlp_bias": True}),
    "llama-8heads-4kv": (LlamaConfig, {**BASE, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 12}),
    "mistral-window3": (MistralConfig, {**BASE, "sliding_window": 3}),
    "qwen2": (Qwen2Config, BASE),
    "qwen3-qk-norm": (Qwen3Config, {**BASE, "attention_bias": True}),
    "mixtral": (MixtralConfig, {**BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 40}),
    "bloom": (BloomConfig, BLOOM_BASE),
    "bloom-6heads": (BloomConfig, {**BLOOM_BASE, "hidden_size": 96, "n_head": 6}),  # slopes: 4 powers + 2 odd ones
    "bloom-10heads-post-ln": (BloomConfig, {**BLOOM_BASE, "hidden_size": 80, "n_head": 10,
                                            "apply_residual_connection_post_layernorm": True}),
    "falcon-7b-multi-query": (FalconConfig, {**FALCON_BASE, **FALCON_7B}),
    "falcon-7b-multi-query-bias": (FalconConfig, {**FALCON_BASE, **FALCON_7B, "bias": True}),
    "falcon-40b-grouped": (FalconConfig, {**FALCON_BASE, **FALCON_40B}),
    "falcon-40b-grouped-bias": (FalconConfig, {**FALCON_BASE, **FALCON_40B, "bias": True}),
    "falcon2-11b-one-ln": (FalconConfig, {**FALCON_BASE, **FALCON_40B, "num_ln_in_parallel_attn": 1}),
    "falcon-sequential": (FalconConfig, {**FALCON_BASE, "parallel_attn": False, "multi_query": False}),
}


def make_blocks(case_id: str, seed: int = 0) -> tuple[PretrainedConfig, list[torch.nn.Module]]:
    """Two blocks of the case's family with random weights drawn large enough to make attention and routing uneven."""
    cls, kwargs = CASES[case_id]
    config = cls(**kwargs)
    family = get_family(config)
    torch.manual_seed(seed)
    blocks = []
    for index in range(2):
        block = family.block_class(config, index).eval().requires_grad_(False)
        with torch.no_grad():
            for name, p in block.named_parameters():
                is_norm = "norm" in name or name.startswith(("ln_attn", "ln_mlp"))
                p.copy_(1 + 0.2 * torch.randn_like(p) if is_norm else 0.08 * torch.randn_like(p))
        blocks.append(block)
    return config, blocks


def make_stacks(case_id: str, num_shards: int) -> tuple[BlockStack, BlockStack]:
    config, blocks = make_blocks(case_id)
    family = get_family(config)
    layout = KVLayout(*family.kv_layout(config))
    sharded = [build_tensor_parallel_block(family, config, b, ["cpu"] * num_shards) for b in blocks]
    return (BlockStack(blocks, 0, config.hidden_size, layout, torch.float32, torch.device("cpu")),
            tensor_parallel_stack(sharded, 0, config.hidden_size, layout, torch.float32))


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    err = (actual - expected).abs().max().item()
    assert err <= ATOL, f"max abs error {err}"


@pytest.mark.parametrize("num_shards", [2, 3])
@pytest.mark.parametrize("case_id", list(CASES))
def test_sharded_forward_equals_unsharded_block(case_id: str, num_shards: int) -> None:
    full, sharded = make_stacks(case_id, num_shards)
    x = torch.randn(2, 7, full.hidden_size)
    assert_close(sharded.forward(x, 0, 2), full.forward(x, 0, 2))


@pytest.mark.parametrize("num_shards", [2, 3])
@pytest.mark.parametrize("case_id", list(CASES))
def test_sharded_prefill_then_cached_steps_equal_unsharded(case_id: str, num_shards: int) -> None:
    full, sharded = make_stacks(case_id, num_shards)
    full_cache = full.allocate_cache(2, 12, 0, 2)
    shard_cache = sharded.allocate_cache(2, 12, 0, 2)
    prompt = torch.randn(2, 5, full.hidden_size)
    assert_close(sharded.inference_step(prompt, shard_cache, 0), full.inference_step(prompt, full_cache, 0))
    for position in range(5, 10):
        x = torch.randn(2, 1, full.hidden_size)
        assert_close(sharded.inference_step(x, shard_cache, position), full.inference_step(x, full_cache, position))
    for j in range(2):  # each shard holds its own KV heads: concatenated, they are the unsharded cache
        for t in range(2):
            if getattr(sharded.blocks[j].shards[0], "kv_replicated", False):  # multi-query: each holds a copy
                for pair in shard_cache.kv(j):
                    assert_close(pair[t], full_cache.kv(j)[t])
            else:
                assert_close(torch.cat([pair[t] for pair in shard_cache.kv(j)], dim=1), full_cache.kv(j)[t])


@pytest.mark.parametrize("num_shards", [2, 3])
@pytest.mark.parametrize("case_id", ["llama-gqa", "llama-8heads-4kv", "mistral-window3", "qwen3-qk-norm", "mixtral",
                                     "bloom-6heads", "bloom-10heads-post-ln", "falcon-7b-multi-query-bias",
                                     "falcon-40b-grouped", "falcon-sequential"])
def test_sharded_batched_decode_equals_unsharded(case_id: str, num_shards: int) -> None:
    full, sharded = make_stacks(case_id, num_shards)
    steps_full, steps_sharded = [], []
    for batch, prompt_len in [(1, 3), (2, 6), (1, 1)]:  # sessions at different positions
        full_cache, shard_cache = full.allocate_cache(batch, 10, 0, 2), sharded.allocate_cache(batch, 10, 0, 2)
        prompt = torch.randn(batch, prompt_len, full.hidden_size)
        full.inference_step(prompt, full_cache, 0)
        sharded.inference_step(prompt, shard_cache, 0)
        x = torch.randn(batch, 1, full.hidden_size)
        steps_full.append((x, full_cache, prompt_len))
        steps_sharded.append((x, shard_cache, prompt_len))
    for out_sharded, out_full in zip(sharded.decode_batch(steps_sharded), full.decode_batch(steps_full), strict=True):
        assert_close(out_sharded, out_full)


def test_shards_hold_whole_kv_groups_with_their_query_heads() -> None:
    config, blocks = make_blocks("llama-8heads-4kv")
    tp = build_tensor_parallel_block(get_family(config), config, blocks[0], ["cpu"] * 3)
    assert [s.n_kv_heads for s in tp.shards] == [2, 1, 1]
    assert [s.block.self_attn.n_heads for s in tp.shards] == [4, 2, 2]
    q = blocks[0].self_attn.q_proj.weight  # (8 * 12, H): query heads 4, 5 read kv head 2, which shard 1 holds
    assert torch.equal(tp.shards[1].block.self_attn.q_proj.weight, q[4 * 12 : 6 * 12])
    assert [s.block.mlp.gate_proj.out_features for s in tp.shards] == [34, 33, 33]


def test_split_evenly_gives_contiguous_ranges_larger_first() -> None:
    assert split_evenly(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert split_evenly(6, 3) == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(ValueError):
        split_evenly(2, 3)


def test_bloom_shards_hold_whole_heads_and_the_full_models_alibi_slopes() -> None:
    config, blocks = make_blocks("bloom-10heads-post-ln")
    tp = build_tensor_parallel_block(get_family(config), config, blocks[0], ["cpu"] * 3)
    assert [s.n_kv_heads for s in tp.shards] == [4, 3, 3]
    qkv = blocks[0].self_attention.query_key_value.weight  # (3 * 10 * 8, H), per head [q k v]
    assert torch.equal(tp.shards[1].self_attention.query_key_value.weight, qkv[3 * 4 * 8 : 3 * 7 * 8])
    full_bias = blocks[0].self_attention._bias(1, 5, 4, torch.float32, torch.device("cpu"))  # (1, 10, 1, 5)
    assert torch.equal(tp.shards[1].self_attention._bias(1, 5, 4, torch.float32, torch.device("cpu")), full_bias[:, 4:7])
    assert not tp.shards[1].self_attention.dense.bias.any() and tp.shards[0].self_attention.dense.bias.any()


def test_falcon_multi_query_shards_split_query_heads_and_copy_the_kv_head() -> None:
    config, blocks = make_blocks("falcon-7b-multi-query-bias")
    family = get_family(config)
    tp = build_tensor_parallel_block(family, config, blocks[0], ["cpu"] * 5)
    assert [s.self_attention.n_heads for s in tp.shards] == [3, 3, 2, 2, 2]
    assert [s.n_kv_heads for s in tp.shards] == [1] * 5
    qkv = blocks[0].self_attention.query_key_value.weight  # (14 * 8, H): 12 query heads, then k, then v
    for shard in tp.shards:
        assert torch.equal(shard.self_attention.query_key_value.weight[-16:], qkv[-16:])
    assert torch.equal(tp.shards[2].self_attention.query_key_value.weight[:16], qkv[6 * 8 : 8 * 8])
    stack = tensor_parallel_stack([tp], 0, config.hidden_size, KVLayout(*family.kv_layout(config)), torch.float32)
    assert stack.layout.n_kv_heads == 5  # cache memory counts every copy of the KV head


@pytest.mark.parametrize(("case_id", "devices", "message"), [
    ("llama-8heads-4kv", 5, "cannot split 4 KV heads over 5 tensor-parallel devices"),
    ("bloom-6heads", 7, "cannot split 6 attention heads over 7 tensor-parallel devices.*use at most 6"),
    ("falcon-7b-multi-query", 13, "cannot split 12 query heads over 13 tensor-parallel devices.*use at most 12"),
    ("falcon-40b-grouped", 5, "cannot split 4 KV heads over 5 tensor-parallel devices.*use at most 4"),
])
def test_more_devices_than_heads_is_a_clear_error(case_id: str, devices: int, message: str) -> None:
    config, blocks = make_blocks(case_id)
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(get_family(config), config, ["cpu"] * devices)
    with pytest.raises(ValueError, match=message):
        build_tensor_parallel_block(get_family(config), config, blocks[0], ["cpu"] * devices)


def test_unsupported_family_is_a_clear_error() -> None:
    config = LlamaConfig(**BASE)
    family = dataclasses.replace(get_family(config), name="gpt2")  # a family with no sharder
    with pytest.raises(ValueError, match="tensor parallelism is not supported for gpt2 yet"):
        check_tensor_parallel(family, config, ["cpu", "cpu"])


def test_a_plain_kv_pair_is_rejected_by_a_sharded_block() -> None:
    config, blocks = make_blocks("llama-gqa")
    tp = build_tensor_parallel_block(get_family(config), config, blocks[0], ["cpu", "cpu"])
    k = torch.zeros(1, 6, 8, 8)
    with pytest.raises(ValueError, match="one KV cache per shard"):
        tp(torch.randn(1, 1, 96), (k, k.clone()), 0)


@pytest.mark.parametrize("mode", ["int8", "nf4"])
@pytest.mark.parametrize("case_id", ["llama-gqa", "mixtral", "bloom-6heads", "falcon-7b-multi-query"])
@torch.no_grad()
def test_quantized_shards_err_about_as_much_as_the_block_quantized_on_one_device(case_id: str, mode: str) -> None:
    """Shards quantize their own slices (row-parallel layers: other int8 rows, other nf4 blocks), so the error differs
    from one device's, but not by much. Measured on these cases (a block's contribution, max abs error / max |ref|):
    sharded / one device, int8 0.007-0.013 / 0.008-0.014; nf4 0.26-0.50 / 0.36-0.54 (these tiny blocks' weights
    quantize worse than real ones; see test_quantization.py)."""
    pytest.importorskip("bitsandbytes")
    config, blocks = make_blocks(case_id)
    family = get_family(config)
    sharded = build_tensor_parallel_block(family, config, copy.deepcopy(blocks[0]), ["cpu", "cpu"], quant=mode)
    whole = quantize_block(copy.deepcopy(blocks[0]), mode, "cpu", torch.float32)
    assert all(quantized_linear_count(shard) > 0 for shard in sharded.shards)
    assert resident_bytes(sharded) < 0.5 * resident_bytes(blocks[0])
    x = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(3))
    ref = blocks[0](x) - x  # the float block's contribution, without the residual

    def error(block: torch.nn.Module) -> float:
        return ((block(x) - x - ref).abs().max() / ref.abs().max()).item()

    assert 1e-4 < error(sharded) < 1.5 * error(whole)  # > 0: the shards really are quantized
    cache = sharded.allocate_kv(2, 12, torch.float32)  # cached steps give what the cache-less pass gives
    steps = torch.cat([sharded(x[:, :5], cache, 0), sharded(x[:, 5:], cache, 5)], dim=1)
    assert (steps - sharded(x)).abs().max().item() < 1e-4


def test_throughput_is_measured_through_the_shards() -> None:
    _, sharded = make_stacks("llama-gqa", 2)
    assert measure_throughput(sharded, steps=3) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case_id", ["llama-gqa", "qwen3-qk-norm", "mixtral", "bloom-6heads", "falcon-7b-multi-query"])
def test_shards_on_cuda_equal_unsharded_block(case_id: str) -> None:
    config, blocks = make_blocks(case_id)
    family = get_family(config)
    layout = KVLayout(*family.kv_layout(config))
    devices = [f"cuda:{i % torch.cuda.device_count()}" for i in range(2)]
    sharded = tensor_parallel_stack(
        [build_tensor_parallel_block(family, config, b, devices) for b in blocks], 0, config.hidden_size, layout, torch.float32
    )
    full = BlockStack([b.to("cuda:0") for b in blocks], 0, config.hidden_size, layout, torch.float32, torch.device("cuda:0"))
    full_cache, shard_cache = full.allocate_cache(2, 12, 0, 2), sharded.allocate_cache(2, 12, 0, 2)
    torch.manual_seed(1)
    for position, length in [(0, 5), (5, 1), (6, 1)]:
        x = torch.randn(2, length, config.hidden_size, device="cuda:0")
        assert_close(sharded.inference_step(x, shard_cache, position), full.inference_step(x, full_cache, position))


@pytest.mark.parametrize("num_shards", [2, 3])
@pytest.mark.parametrize("case_id", ["llama-gqa", "bloom-6heads", "falcon-7b-multi-query"])
def test_padded_steps_and_beam_reordering_work_on_sharded_caches(case_id: str, num_shards: int) -> None:
    """The padded-batch and beam-search paths (server.compute.padding) take per-shard caches as they take plain ones."""
    from corolla.server.compute.padding import masked_inference_step

    plain, sharded = make_stacks(case_id, num_shards)
    torch.manual_seed(1)
    hidden = torch.randn(3, 5, plain.hidden_size)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    outputs = []
    for stack in (plain, sharded):
        cache = stack.allocate_cache(3, 16, 0, 2)
        prefill = masked_inference_step(stack, hidden, mask, cache, 0)  # (3, 5, H)
        cache.reorder([2, 2, 0], 5)
        step_mask = torch.cat([mask[[2, 2, 0]], torch.ones(3, 1, dtype=torch.bool)], dim=1)
        decode = masked_inference_step(stack, hidden[:, :1] * 0.5, step_mask, cache, 5)  # rows of 4, 4, 3 tokens
        outputs.append((prefill, decode))
    for actual, expected in zip(outputs[1], outputs[0]):
        assert_close(actual, expected)
