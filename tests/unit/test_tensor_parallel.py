"""Tensor-parallel blocks (shards on several devices, partials summed) against the unsharded block.

The unsharded block is itself checked against HF in tests/models; here every sharded path must give its outputs
within 1e-5 (float32): a cache-less forward, a prefill then single-token cached steps (caches compared too),
and batched decode over several sessions through `TensorParallelStack.decode_batch` (the RaggedKV path).
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    BloomConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from corolla.models import get_family
from corolla.models.llama.sharding import split_evenly
from corolla.server.backend import BlockStack, KVLayout
from corolla.server.config import ServerConfig
from corolla.server.tensor_parallel import (
    TensorParallelStack,
    build_tensor_parallel_block,
    check_tensor_parallel,
    measure_throughput,
)

ATOL = 1e-5
BASE = dict(hidden_size=96, intermediate_size=100, num_attention_heads=12, num_key_value_heads=6, head_dim=8,
            num_hidden_layers=2, vocab_size=64, max_position_embeddings=64, rms_norm_eps=1e-6)

# case id -> (config class, overrides)
CASES: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "llama-gqa": (LlamaConfig, {}),
    "llama-biases": (LlamaConfig, {"attention_bias": True, "mlp_bias": True}),
    "llama-8heads-4kv": (LlamaConfig, {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 12}),
    "mistral-window3": (MistralConfig, {"sliding_window": 3}),
    "qwen2": (Qwen2Config, {}),
    "qwen3-qk-norm": (Qwen3Config, {"attention_bias": True}),
    "mixtral": (MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 40}),
}


def make_blocks(case_id: str, seed: int = 0) -> tuple[PretrainedConfig, list[torch.nn.Module]]:
    """Two blocks of the case's family with random weights drawn large enough to make attention and routing uneven."""
    cls, overrides = CASES[case_id]
    config = cls(**{**BASE, **overrides})
    family = get_family(config)
    torch.manual_seed(seed)
    blocks = []
    for index in range(2):
        block = family.block_class(config, index).eval().requires_grad_(False)
        with torch.no_grad():
            for name, p in block.named_parameters():
                p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
        blocks.append(block)
    return config, blocks


def make_stacks(case_id: str, num_shards: int) -> tuple[BlockStack, TensorParallelStack]:
    config, blocks = make_blocks(case_id)
    family = get_family(config)
    layout = KVLayout(*family.kv_layout(config))
    sharded = [build_tensor_parallel_block(family, config, b, ["cpu"] * num_shards) for b in blocks]
    return (BlockStack(blocks, 0, config.hidden_size, layout, torch.float32, torch.device("cpu")),
            TensorParallelStack(sharded, 0, config.hidden_size, layout, torch.float32))


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
    assert_close(sharded.inference_step(prompt, shard_cache, 0, 0, 2), full.inference_step(prompt, full_cache, 0, 0, 2))
    for position in range(5, 10):
        x = torch.randn(2, 1, full.hidden_size)
        assert_close(sharded.inference_step(x, shard_cache, position, 0, 2), full.inference_step(x, full_cache, position, 0, 2))
    for j in range(2):  # each shard holds its own KV heads: concatenated, they are the unsharded cache
        for t in range(2):
            assert_close(torch.cat([pair[t] for pair in shard_cache[j]], dim=1), full_cache[j][t])


@pytest.mark.parametrize("num_shards", [2, 3])
@pytest.mark.parametrize("case_id", ["llama-gqa", "llama-8heads-4kv", "mistral-window3", "qwen3-qk-norm", "mixtral"])
def test_sharded_batched_decode_equals_unsharded(case_id: str, num_shards: int) -> None:
    full, sharded = make_stacks(case_id, num_shards)
    steps_full, steps_sharded = [], []
    for batch, prompt_len in [(1, 3), (2, 6), (1, 1)]:  # sessions at different positions
        full_cache, shard_cache = full.allocate_cache(batch, 10, 0, 2), sharded.allocate_cache(batch, 10, 0, 2)
        prompt = torch.randn(batch, prompt_len, full.hidden_size)
        full.inference_step(prompt, full_cache, 0, 0, 2)
        sharded.inference_step(prompt, shard_cache, 0, 0, 2)
        x = torch.randn(batch, 1, full.hidden_size)
        steps_full.append((x, full_cache, prompt_len, 0, 2))
        steps_sharded.append((x, shard_cache, prompt_len, 0, 2))
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


def test_more_devices_than_kv_heads_is_a_clear_error() -> None:
    config, blocks = make_blocks("llama-8heads-4kv")
    with pytest.raises(ValueError, match="cannot split 4 KV heads over 5 tensor-parallel devices"):
        build_tensor_parallel_block(get_family(config), config, blocks[0], ["cpu"] * 5)


def test_unsupported_family_is_a_clear_error() -> None:
    config = BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=64)
    with pytest.raises(ValueError, match="tensor parallelism is not supported for bloom yet"):
        check_tensor_parallel(get_family(config), config, ["cpu", "cpu"])


def test_a_plain_kv_pair_is_rejected_by_a_sharded_block() -> None:
    config, blocks = make_blocks("llama-gqa")
    tp = build_tensor_parallel_block(get_family(config), config, blocks[0], ["cpu", "cpu"])
    k = torch.zeros(1, 6, 8, 8)
    with pytest.raises(ValueError, match="one KV cache per shard"):
        tp(torch.randn(1, 1, 96), (k, k.clone()), 0)


def test_server_refuses_tensor_parallel_with_quantization() -> None:
    from corolla.server.server import Server

    config = ServerConfig(model="unused", new_swarm=True, quant="int8", tensor_parallel_devices=("cpu", "cpu"))
    with pytest.raises(ValueError, match="cannot be combined with --quant"):
        Server(config)


def test_throughput_is_measured_through_the_shards() -> None:
    _, sharded = make_stacks("llama-gqa", 2)
    assert measure_throughput(sharded, steps=3) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case_id", ["llama-gqa", "qwen3-qk-norm", "mixtral"])
def test_shards_on_cuda_equal_unsharded_block(case_id: str) -> None:
    config, blocks = make_blocks(case_id)
    family = get_family(config)
    layout = KVLayout(*family.kv_layout(config))
    devices = [f"cuda:{i % torch.cuda.device_count()}" for i in range(2)]
    sharded = TensorParallelStack(
        [build_tensor_parallel_block(family, config, b, devices) for b in blocks], 0, config.hidden_size, layout, torch.float32
    )
    full = BlockStack([b.to("cuda:0") for b in blocks], 0, config.hidden_size, layout, torch.float32, torch.device("cuda:0"))
    full_cache, shard_cache = full.allocate_cache(2, 12, 0, 2), sharded.allocate_cache(2, 12, 0, 2)
    torch.manual_seed(1)
    for position, length in [(0, 5), (5, 1), (6, 1)]:
        x = torch.randn(2, length, config.hidden_size, device="cuda:0")
        assert_close(sharded.inference_step(x, shard_cache, position, 0, 2), full.inference_step(x, full_cache, position, 0, 2))


@pytest.mark.parametrize("num_shards", [2, 3])
def test_padded_steps_and_beam_reordering_work_on_sharded_caches(num_shards: int) -> None:
    """The padded-batch and beam-search paths (server.padding) take per-shard caches as they take plain ones."""
    from corolla.server.padding import masked_inference_step, reorder_cache

    plain, sharded = make_stacks("llama-gqa", num_shards)
    torch.manual_seed(1)
    hidden = torch.randn(3, 5, plain.hidden_size)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    outputs = []
    for stack in (plain, sharded):
        cache = stack.allocate_cache(3, 16, 0, 2)
        prefill = masked_inference_step(stack, hidden, mask, cache, 0, 0, 2)  # (3, 5, H)
        reorder_cache(cache, [2, 2, 0], 5)
        step_mask = torch.cat([mask[[2, 2, 0]], torch.ones(3, 1, dtype=torch.bool)], dim=1)
        decode = masked_inference_step(stack, hidden[:, :1] * 0.5, step_mask, cache, 5, 0, 2)  # rows of 4, 4, 3 tokens
        outputs.append((prefill, decode))
    for actual, expected in zip(outputs[1], outputs[0]):
        assert_close(actual, expected)
