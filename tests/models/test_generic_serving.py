"""What a server does with blocks, on generic blocks: cache allocation (rings for sliding-window layers), padded
batches, batched decode beside a padded session, beam reordering (sessions past the window: on rings), backward
(server.compute.padding, server.compute.block_stack, server.compute.forward_backward), --quant int8/nf4 (models.quantization) and peft LoRA adapters
(server.loading.adapters, against peft itself)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from generic_cases import case_config, generic_case, one_thread  # noqa: F401
from reference import ATOL, make_reference, token_ids
from test_lora import layer_io, save_adapter

from corolla.models import get_family
from corolla.models.lora import LoraLinear, using_adapter
from corolla.server.loading.adapters import attach_adapters
from corolla.server.compute.block_stack import BlockStack, KVLayout
from corolla.server.compute.padding import masked_inference_step
from corolla.models.quantization import estimate_block_bytes, quantize_block, quantized_linear_count, resident_bytes

pytestmark = pytest.mark.usefixtures("one_thread")
LENGTHS = (5, 2, 7)  # real tokens of three rows, left-padded to 7


def stack_of(case_id: str) -> BlockStack:
    """The blocks as a server stacks them: sliding-window layers of sessions over 2 x 4 + 1 tokens keep rings."""
    _, blocks, _ = generic_case(case_id)
    config = case_config(case_id)
    return BlockStack(blocks, 0, 64, KVLayout(blocks[0].n_kv_heads, blocks[0].head_dim), torch.float32,
                      torch.device("cpu"), cache_length=partial(get_family(config).cache_length, config))


def test_a_stack_allocates_rings_for_sliding_layers_and_counts_their_bytes() -> None:
    stack = stack_of("gemma2")  # layers 0 and 2 slide (window 4), 1 and 3 attend to everything
    cache = stack.allocate_cache(3, 100, 1, 4)
    assert [keys.shape for keys, _ in cache.pairs()] == [(3, 2, 100, 16), (3, 2, 9, 16), (3, 2, 100, 16)]
    per_position = 2 * 2 * 16 * 4  # keys and values, 2 KV heads of 16 float32
    assert stack.cache_bytes(3, 100, 1, 4) == 3 * per_position * (100 + 9 + 100)
    assert [k.shape[2] for k, _ in stack.allocate_cache(1, 8, 0, 4).pairs()] == [8, 8, 8, 8]  # short sessions: no ring
    assert stack_of("qwen3_moe").cache_bytes(1, 100, 0, 4) == per_position * 400  # no sliding layer


def test_a_sessions_share_of_the_token_budget_is_what_its_blocks_keep() -> None:
    """A budget token is one position in every hosted block (4 here): rings and shorter spans take less of it."""
    stack = stack_of("gemma2")
    assert stack_of("qwen3_moe").cache_tokens(3, 100, 0, 4) == 300  # batch x max_length: no ring, every block
    assert stack.cache_tokens(3, 100, 0, 4) == -(-3 * (100 + 9 + 100 + 9) // 4)  # two rings of 9 positions
    assert stack.cache_tokens(3, 100, 1, 4) == -(-3 * (100 + 9 + 100) // 4)
    assert stack.cache_tokens(1, 8, 0, 4) == 8  # short sessions keep every position


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.shape[1] for r in rows)
    hidden, mask = torch.zeros(len(rows), width, rows[0].shape[2]), torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        hidden[i, width - r.shape[1]:], mask[i, width - r.shape[1]:] = r[0], True
    return hidden, mask


@pytest.mark.parametrize("case_id", ["gemma2", "qwen3_moe", "gpt_oss"])
def test_padded_session_steps_on_generic_blocks_equal_each_row_alone(case_id: str) -> None:
    """Prefill a left-padded batch, three single-token steps (rows at different lengths, past the window of 4),
    then a 2-token step."""
    stack = stack_of(case_id)
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randn(1, n, 64, generator=gen) for n in LENGTHS]
    steps = [torch.randn(3, 1, 64, generator=gen) for _ in range(3)] + [torch.randn(3, 2, 64, generator=gen)]
    hidden, mask = left_padded(rows)
    cache = stack.allocate_cache(3, 16, 0, 4)
    outputs = [masked_inference_step(stack, hidden, mask, cache, 0)]
    position = hidden.shape[1]
    for step in steps:
        mask = torch.cat([mask, torch.ones(3, step.shape[1], dtype=torch.bool)], dim=1)
        outputs.append(masked_inference_step(stack, step, mask, cache, position))
        position += step.shape[1]
    for i, row in enumerate(rows):
        alone = stack.allocate_cache(1, 16, 0, 4)
        expected = [stack.inference_step(row, alone, 0)]
        at = row.shape[1]
        for step in steps:
            expected.append(stack.inference_step(step[i : i + 1], alone, at))
            at += step.shape[1]
        torch.testing.assert_close(outputs[0][i, -row.shape[1]:], expected[0][0], atol=ATOL, rtol=0)
        for got, want in zip(outputs[1:], expected[1:]):
            torch.testing.assert_close(got[i], want[0], atol=ATOL, rtol=0)


def test_padded_forward_and_backward_on_generic_blocks_give_each_row_its_own() -> None:
    stack = stack_of("cohere2")
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randn(1, n, 64, generator=gen) for n in LENGTHS]
    hidden, mask = left_padded(rows)
    grad_out = torch.randn(hidden.shape, generator=gen)
    out = stack.forward(hidden, 0, 4, mask=mask)
    grad_hidden, _ = stack.backward(hidden, grad_out, 0, 4, None, mask)
    for i, row in enumerate(rows):
        torch.testing.assert_close(out[i, mask[i]], stack.forward(row, 0, 4)[0], atol=ATOL, rtol=0)
        g_row, _ = stack.backward(row, grad_out[i : i + 1, mask[i]], 0, 4)
        torch.testing.assert_close(grad_hidden[i, mask[i]], g_row[0], atol=ATOL, rtol=0)
    assert torch.equal(out[~mask], hidden[~mask]) and torch.equal(grad_hidden[~mask], grad_out[~mask])


def test_a_padded_sessions_decode_step_batches_with_another_sessions_step_on_generic_blocks() -> None:
    stack = stack_of("gemma3_text")
    gen = torch.Generator().manual_seed(8)
    rows = [torch.randn(1, n, 64, generator=gen) for n in LENGTHS]
    hidden, mask = left_padded(rows)
    other_prompt, other_token = torch.randn(2, 6, 64, generator=gen), torch.randn(2, 1, 64, generator=gen)
    step = torch.randn(3, 1, 64, generator=gen)
    full = torch.cat([mask, torch.ones(3, 1, dtype=torch.bool)], dim=1)
    padded, apart, other, other_apart = (stack.allocate_cache(b, 16, 0, 4) for b in (3, 3, 2, 2))
    for cache in (padded, apart):
        masked_inference_step(stack, hidden, mask, cache, 0)
    for cache in (other, other_apart):
        stack.inference_step(other_prompt, cache, 0)
    lengths = mask.sum(dim=1).tolist()
    got, got_other = stack.decode_batch([(step, padded, lengths), (other_token, other, 6)])
    torch.testing.assert_close(got, masked_inference_step(stack, step, full, apart, 7), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_other, stack.inference_step(other_token, other_apart, 6), atol=ATOL, rtol=0)


@pytest.mark.parametrize("case_id", ["gemma3_text", "qwen3_moe"])
def test_a_reordered_generic_cache_continues_the_chosen_rows(case_id: str) -> None:
    stack = stack_of(case_id)
    gen = torch.Generator().manual_seed(4)
    prompt, steps = torch.randn(3, 6, 64, generator=gen), torch.randn(3, 3, 64, generator=gen)
    cache = stack.allocate_cache(3, 16, 0, 4)
    stack.inference_step(prompt, cache, 0)
    hypo_ids = [2, 0, 0]
    cache.reorder(hypo_ids, 6)
    fresh = stack.allocate_cache(3, 16, 0, 4)
    stack.inference_step(prompt[hypo_ids], fresh, 0)
    for t in range(3):
        got = stack.inference_step(steps[:, t : t + 1], cache, 6 + t)
        torch.testing.assert_close(got, stack.inference_step(steps[:, t : t + 1], fresh, 6 + t), atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", ["int8", "nf4"])
@pytest.mark.parametrize("case_id", ["qwen3_moe", "gemma2"])
def test_quantized_generic_blocks_hold_bitsandbytes_linears_and_stay_near_float(case_id: str, mode: str) -> None:
    """The HF layer's nn.Linear modules are swapped like ours (norms, the MoE router and fused 3-D experts stay in
    the server dtype); the block's contribution errs about as much as our own quantized blocks' (tests/unit)."""
    reference, _, _ = generic_case(case_id)
    config = case_config(case_id)
    family = get_family(config)
    state = {family.canonical_name(k): v for k, v in reference.state_dict().items()}
    float_block = family.load_block(config, 0, state).eval()
    with torch.device("meta"):
        estimated = estimate_block_bytes(family.block_class(config, 0), mode, torch.float32)
    block = quantize_block(family.load_block(config, 0, state).eval(), mode, torch.device("cpu"), torch.float32)
    assert quantized_linear_count(block) == (4 if case_id == "qwen3_moe" else 7)  # attention (+ MLP for gemma2)
    assert resident_bytes(block) == estimated < resident_bytes(float_block)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = float_block(x) - x, block(x) - x  # the block's contribution (without the residual)
    relative = ((got - want).abs().max() / want.abs().max()).item()
    assert relative < (0.05 if mode == "int8" else 0.4), relative


@pytest.mark.parametrize(("case_id", "targets"), [
    ("qwen3_moe", ["q_proj", "k_proj", "v_proj", "o_proj"]),
    ("gemma2", ["q_proj", "v_proj", "gate_proj", "down_proj"]),
])
def test_generic_blocks_with_a_peft_adapter_equal_peft_layers(case_id: str, targets: list[str], tmp_path: Path) -> None:
    config = case_config(case_id)
    model = make_reference(config, norms=() if case_id.startswith("gemma") else ("norm.weight",))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    peft_model = save_adapter(model, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=targets)
    family = get_family(config)
    canonical = {family.canonical_name(k): v for k, v in state.items()}
    blocks = [family.load_block(config, i, canonical).eval() for i in range(family.num_blocks(config))]
    attach_adapters(blocks, 0, [str(tmp_path / "adapter")], family, config, dtype=torch.float32,
                    device=torch.device("cpu"))
    assert isinstance(blocks[0].layer.self_attn.q_proj, LoraLinear)
    ios = layer_io(peft_model, token_ids())
    with torch.no_grad(), using_adapter(str(tmp_path / "adapter")):
        for i, (block, (x, expected)) in enumerate(zip(blocks, ios, strict=True)):
            torch.testing.assert_close(block(x), expected, atol=ATOL, rtol=0, msg=lambda m: f"layer {i}: {m}")
    with torch.no_grad(), peft_model.disable_adapter():
        base = layer_io(peft_model, token_ids())
    with torch.no_grad():
        for block, (x, expected) in zip(blocks, base):
            torch.testing.assert_close(block(x), expected, atol=ATOL, rtol=0)
