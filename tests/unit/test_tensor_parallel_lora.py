"""LoRA adapters on tensor-parallel blocks against the same adapter on the unsharded block.

A random adapter (non-zero A and B, r=4, a scale != 1) on column- and row-parallel layers (and Mixtral's
replicated router) is attached to the unsharded block and to its 2- and 3-shard split; with the adapter active the
outputs must agree within 1e-5 (float32), and with no adapter active the sharded block must still give the base
outputs. The unsharded block with an adapter is itself checked against peft in tests/models/test_lora.py.
"""

from __future__ import annotations

import pytest
import torch
from test_tensor_parallel import CASES, make_blocks
from torch import nn

from corolla.models import get_family
from corolla.models.lora import LoraLinear, LoraWeights, attach_lora, using_adapter
from corolla.server.compute.tensor_parallel import (
    TensorParallelBlock,
    build_tensor_parallel_block,
)
from corolla.server.compute.tensor_parallel_lora import attach_tensor_parallel_lora

ATOL = 1e-5
LLAMA_LAYERS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
FUSED_LAYERS = ["self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"]
# case id (tests/unit/test_tensor_parallel.py) -> adapted layers: column- and row-parallel ones in each
TARGETS: dict[str, list[str]] = {
    "llama-gqa": LLAMA_LAYERS,
    "llama-biases": LLAMA_LAYERS,
    "mixtral": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate"],
    "bloom": FUSED_LAYERS,
    "bloom-6heads": FUSED_LAYERS,
    "falcon-7b-multi-query": FUSED_LAYERS,
    "falcon-7b-multi-query-bias": FUSED_LAYERS,
    "falcon-40b-grouped": FUSED_LAYERS,
    "falcon-sequential": FUSED_LAYERS,
}


def random_lora(block: nn.Module, layers: list[str], seed: int, rank: int = 4, scale: float = 1.75) -> dict[str, LoraWeights]:
    """Random non-zero updates for ``layers`` of ``block``: ``A x`` of about the size of ``x``, ``B`` small, so that
    the outputs move visibly but stay of the base outputs' size (float32 rounding grows with them)."""
    generator = torch.Generator().manual_seed(seed)
    updates = {}
    for path in layers:
        linear = block.get_submodule(path)
        A = torch.randn(rank, linear.in_features, generator=generator) / linear.in_features**0.5  # (r, in)
        B = 0.1 * torch.randn(linear.out_features, rank, generator=generator)  # (out, r)
        updates[path] = LoraWeights(A, B, scale)
    return updates


def split(block: nn.Module, config, num_shards: int) -> TensorParallelBlock:
    return build_tensor_parallel_block(get_family(config), config, block, ["cpu"] * num_shards)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.mark.parametrize("num_shards", [2, 3])
@pytest.mark.parametrize("case_id", list(TARGETS))
def test_sharded_block_with_adapter_equals_unsharded_block_with_adapter(case_id: str, num_shards: int) -> None:
    config, (block, _) = make_blocks(case_id)
    sharded = split(block, config, num_shards)
    x = torch.randn(2, 7, config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = block(x)
        sharded_base = sharded(x)
    updates = random_lora(block, TARGETS[case_id], seed=11)
    attach_lora(block, "ad", updates, torch.float32, torch.device("cpu"))
    attach_tensor_parallel_lora(sharded, "ad", updates, torch.float32)
    with torch.no_grad():
        with using_adapter("ad"):
            expected, actual = block(x), sharded(x)
        sharded_off = sharded(x)
        with using_adapter("other"):  # an adapter these layers do not hold: the base layers
            sharded_other = sharded(x)
    assert max_diff(expected, base) > 1e-2, "the adapter should change the block's output"
    assert max_diff(actual, expected) <= ATOL
    assert torch.equal(sharded_off, sharded_base) and torch.equal(sharded_other, sharded_base)


@pytest.mark.parametrize("case_id", ["llama-gqa", "mixtral", "bloom-6heads", "falcon-7b-multi-query", "falcon-40b-grouped"])
def test_every_adapted_layer_alone_matches_so_no_slice_compensates_another(case_id: str) -> None:
    """One layer per adapter, each its own named adapter: a wrong slice cannot hide behind another layer's."""
    config, (block, _) = make_blocks(case_id)
    sharded = split(block, config, 3)
    x = torch.randn(1, 5, config.hidden_size, generator=torch.Generator().manual_seed(4))
    for i, path in enumerate(TARGETS[case_id]):
        updates = random_lora(block, [path], seed=20 + i)
        attach_lora(block, path, updates, torch.float32, torch.device("cpu"))
        attach_tensor_parallel_lora(sharded, path, updates, torch.float32)
    with torch.no_grad():
        base = block(x)
        for path in TARGETS[case_id]:
            with using_adapter(path):
                expected = block(x)
                assert max_diff(expected, base) > 1e-3, f"{path}'s update should change the output"
                assert max_diff(sharded(x), expected) <= ATOL, path


def test_shards_hold_the_adapter_slices_on_their_own_layers() -> None:
    """Column-parallel layers get rows of B, row-parallel ones columns of A; shapes fit each shard's layers."""
    config, (block, _) = make_blocks("llama-gqa")
    sharded = split(block, config, 2)
    updates = random_lora(block, ["self_attn.q_proj", "mlp.down_proj"], seed=5)
    attach_tensor_parallel_lora(sharded, "ad", updates, torch.float32)
    q_rows = [shard.block.self_attn.q_proj.adapters["ad"].B for shard in sharded.shards]
    down_cols = [shard.block.mlp.down_proj.adapters["ad"].A for shard in sharded.shards]
    assert all(isinstance(shard.block.self_attn.q_proj, LoraLinear) for shard in sharded.shards)
    assert torch.equal(torch.cat(q_rows, dim=0), updates["self_attn.q_proj"].B)
    assert torch.equal(torch.cat(down_cols, dim=1), updates["mlp.down_proj"].A)
    assert all(torch.equal(shard.block.self_attn.q_proj.adapters["ad"].A, updates["self_attn.q_proj"].A)
               for shard in sharded.shards)


def test_an_adapter_that_does_not_fit_is_refused_before_any_shard_changes() -> None:
    config, (block, _) = make_blocks("bloom")
    sharded = split(block, config, 2)
    good = random_lora(block, ["mlp.dense_h_to_4h"], seed=1)
    wrong_shape = {**good, "self_attention.dense": LoraWeights(torch.ones(4, 7), torch.ones(64, 4), 1.0)}
    with pytest.raises(ValueError, match=r"self_attention.dense.*do not fit"):
        attach_tensor_parallel_lora(sharded, "ad", wrong_shape, torch.float32)
    with pytest.raises(ValueError, match=r"'input_layernorm', which tensor-parallel shards of this block cannot split"):
        attach_tensor_parallel_lora(sharded, "ad", {**good, "input_layernorm": good["mlp.dense_h_to_4h"]}, torch.float32)
    assert not any(isinstance(m, LoraLinear) for m in sharded.modules())
    attach_tensor_parallel_lora(sharded, "ad", good, torch.float32)
    with pytest.raises(ValueError, match="already attached"):
        attach_tensor_parallel_lora(sharded, "ad", good, torch.float32)


def test_every_case_of_the_sharding_tests_gives_each_linear_a_split() -> None:
    """Every linear layer of every tensor-parallel case can take an adapter, with a split whose parts cover the
    layer once (column- and row-parallel) or are whole in every shard (replicated)."""
    for case_id in CASES:
        config, (block, _) = make_blocks(case_id)
        sharded = split(block, config, 3)
        linears = {name for name, m in block.named_modules() if isinstance(m, nn.Linear)}
        for path in linears:
            parts = [shard.linear_slices[path] for shard in sharded.shards]
            assert parts[0].full_shape == tuple(block.get_submodule(path).weight.shape), (case_id, path)
            if parts[0].dim is None:
                assert all(p.dim is None for p in parts), (case_id, path)
                continue
            size = parts[0].full_shape[parts[0].dim]
            indices = [p.index for p in parts]
            if getattr(sharded.shards[0], "kv_replicated", False) and path == "self_attention.query_key_value":
                kv_rows = torch.arange(size - 2 * sharded.shards[0].head_dim, size)  # the one KV head's k and v rows
                assert all(torch.equal(i[-len(kv_rows):], kv_rows) for i in indices), case_id  # copied to every shard
                indices = [i[: -len(kv_rows)] for i in indices] + [kv_rows]
            assert torch.equal(torch.cat(indices).sort().values, torch.arange(size)), (case_id, path)
