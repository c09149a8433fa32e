"""Padded batches, deep prompts and beam reordering on a server, for every family: each row of a left-padded batch
gives exactly what that row gives alone (forward, backward, prefill, ragged decode steps, multi-token steps,
reordering), and deep prompts give in a cached session what they give in a cache-less forward."""

from __future__ import annotations

import pytest
import torch
from reference import FAMILY_CONFIGS
from transformers import (
    AutoModelForCausalLM,
)

from corolla.models import get_family
from corolla.server.compute.block_stack import BlockStack, KVLayout
from corolla.server.compute.padding import (
    check_hypo_ids,
    check_mask,
    check_prompt_slots,
    masked_inference_step,
)

LENGTHS = (5, 2, 7)  # real tokens of the three rows, left-padded to 7
ATOL = 1e-5


def make_stack(config) -> BlockStack:
    torch.manual_seed(0)
    family = get_family(config)
    state = {family.canonical_name(k): v for k, v in AutoModelForCausalLM.from_config(config).eval().state_dict().items()}
    blocks = [family.load_block(config, i, state).eval() for i in range(family.num_blocks(config))]
    return BlockStack(blocks, 0, config.hidden_size, KVLayout(*family.kv_layout(config)), torch.float32, torch.device("cpu"))


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (1, n_i, H) -> hidden (B, max n, H) with zeros on the left, and the bool mask (B, max n)."""
    width = max(r.shape[1] for r in rows)
    hidden = torch.zeros(len(rows), width, rows[0].shape[2])
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        hidden[i, width - r.shape[1]:] = r[0]
        mask[i, width - r.shape[1]:] = True
    return hidden, mask


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_padded_forward_rows_equal_each_row_alone(name):
    stack = make_stack(FAMILY_CONFIGS[name])
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randn(1, n, 64, generator=gen) for n in LENGTHS]
    hidden, mask = left_padded(rows)
    out = stack.forward(hidden, 0, 2, mask=mask)
    for i, row in enumerate(rows):
        torch.testing.assert_close(out[i, mask[i]], stack.forward(row, 0, 2)[0], atol=ATOL, rtol=0)
    assert torch.equal(out[~mask], hidden[~mask])  # padded slots come back unchanged


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_padded_session_steps_equal_each_row_alone(name):
    """Prefill a left-padded batch, three single-token steps (rows at different lengths), then a 2-token step."""
    stack = make_stack(FAMILY_CONFIGS[name])
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randn(1, n, 64, generator=gen) for n in LENGTHS]
    steps = [torch.randn(3, 1, 64, generator=gen) for _ in range(3)] + [torch.randn(3, 2, 64, generator=gen)]
    hidden, mask = left_padded(rows)
    cache = stack.allocate_cache(3, 16, 0, 2)
    outputs = [masked_inference_step(stack, hidden, mask, cache, 0)]
    position = hidden.shape[1]
    for step in steps:
        mask = torch.cat([mask, torch.ones(3, step.shape[1], dtype=torch.bool)], dim=1)
        outputs.append(masked_inference_step(stack, step, mask, cache, position))
        position += step.shape[1]
    for i, row in enumerate(rows):
        alone = stack.allocate_cache(1, 16, 0, 2)
        expected = [stack.inference_step(row, alone, 0)]
        at = row.shape[1]
        for step in steps:
            expected.append(stack.inference_step(step[i : i + 1], alone, at))
            at += step.shape[1]
        torch.testing.assert_close(outputs[0][i, -row.shape[1]:], expected[0][0], atol=ATOL, rtol=0)
        for got, want in zip(outputs[1:], expected[1:]):
            torch.testing.assert_close(got[i], want[0], atol=ATOL, rtol=0)


def test_padded_backward_gives_each_row_its_own_gradients_and_passes_padding_through():
    stack = make_stack(FAMILY_CONFIGS["llama"])
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randn(1, n, 64, generator=gen) for n in LENGTHS]
    hidden, mask = left_padded(rows)
    prompts = 0.1 * torch.randn(2, 2, 64, generator=gen)  # deep prompts on each row's first 2 real slots
    grad_out = torch.randn(hidden.shape, generator=gen)
    grad_hidden, grad_prompts = stack.backward(hidden, grad_out, 0, 2, prompts, mask)
    expected_prompts = torch.zeros_like(prompts)
    for i, row in enumerate(rows):
        g_row, g_prompts = stack.backward(row, grad_out[i : i + 1, mask[i]], 0, 2, prompts)
        torch.testing.assert_close(grad_hidden[i, mask[i]], g_row[0], atol=ATOL, rtol=0)
        expected_prompts += g_prompts
    torch.testing.assert_close(grad_prompts, expected_prompts, atol=ATOL, rtol=0)
    assert torch.equal(grad_hidden[~mask], grad_out[~mask])  # a padded slot's output is its input


@pytest.mark.parametrize("name", ["llama", "bloom", "falcon-40b-style"])
def test_deep_prompts_in_cached_steps_equal_the_cacheless_forward(name):
    """P = 3 deep prompts; the session's steps hold positions [0, 2), [2, 6), [6, 7), [7, 8): the first two
    straddle the prompt positions, the last two are past them."""
    stack = make_stack(FAMILY_CONFIGS[name])
    gen = torch.Generator().manual_seed(6)
    hidden, prompts = torch.randn(2, 8, 64, generator=gen), torch.randn(2, 3, 64, generator=gen)
    expected = stack.forward(hidden, 0, 2, prompts)
    cache = stack.allocate_cache(2, 8, 0, 2)
    got = torch.cat([stack.inference_step(hidden[:, a:b], cache, a, prompts)
                     for a, b in ((0, 2), (2, 6), (6, 7), (7, 8))], dim=1)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert (got - stack.forward(hidden, 0, 2)).abs().max() > 1e-2  # the prompts matter


def test_deep_prompts_with_a_padded_session_land_on_each_rows_first_real_slots():
    """Each row: 2 prompt slots, then its left-padded tokens; the padded session equals each row alone."""
    stack = make_stack(FAMILY_CONFIGS["qwen2"])
    gen = torch.Generator().manual_seed(7)
    prompts = torch.randn(2, 2, 64, generator=gen)
    prompt_slots = torch.randn(1, 2, 64, generator=gen)
    rows = [torch.cat([prompt_slots, torch.randn(1, n, 64, generator=gen)], dim=1) for n in LENGTHS]
    tokens, token_mask = left_padded([row[:, 2:] for row in rows])  # (3, 7, H): padding between prompts and tokens
    hidden = torch.cat([prompt_slots.expand(3, -1, -1), tokens], dim=1)  # (3, 9, H)
    mask = torch.cat([torch.ones(3, 2, dtype=torch.bool), token_mask], dim=1)
    step = torch.randn(3, 1, 64, generator=gen)
    cache = stack.allocate_cache(3, 16, 0, 2)
    first = masked_inference_step(stack, hidden, mask, cache, 0, prompts)
    full = torch.cat([mask, torch.ones(3, 1, dtype=torch.bool)], dim=1)
    second = masked_inference_step(stack, step, full, cache, hidden.shape[1])
    for i, row in enumerate(rows):
        alone = stack.allocate_cache(1, 16, 0, 2)
        torch.testing.assert_close(first[i, mask[i]], stack.inference_step(row, alone, 0, prompts)[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(second[i], stack.inference_step(step[i : i + 1], alone, row.shape[1])[0],
                                   atol=ATOL, rtol=0)
    assert check_prompt_slots(mask, 2) is None
    assert "first 3 slots" in check_prompt_slots(mask, 3)


@pytest.mark.parametrize("name", ["llama", "bloom", "falcon-7b-style"])
def test_a_padded_sessions_decode_step_batches_with_another_sessions_step(name):
    """decode_batch with per-row positions (the padded session's row lengths) beside a plain session's step gives
    what the padded session's own step and the plain step give apart."""
    stack = make_stack(FAMILY_CONFIGS[name])
    gen = torch.Generator().manual_seed(8)
    rows = [torch.randn(1, n, 64, generator=gen) for n in LENGTHS]
    hidden, mask = left_padded(rows)
    other_prompt, other_token = torch.randn(2, 4, 64, generator=gen), torch.randn(2, 1, 64, generator=gen)
    step = torch.randn(3, 1, 64, generator=gen)
    full = torch.cat([mask, torch.ones(3, 1, dtype=torch.bool)], dim=1)
    padded, apart, other, other_apart = (stack.allocate_cache(b, 16, 0, 2) for b in (3, 3, 2, 2))
    for cache in (padded, apart):
        masked_inference_step(stack, hidden, mask, cache, 0)
    for cache in (other, other_apart):
        stack.inference_step(other_prompt, cache, 0)
    lengths = mask.sum(dim=1).tolist()  # [5, 2, 7]
    got, got_other = stack.decode_batch([(step, padded, lengths), (other_token, other, 4)])
    torch.testing.assert_close(got, masked_inference_step(stack, step, full, apart, 7), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_other, stack.inference_step(other_token, other_apart, 4), atol=ATOL, rtol=0)
    alone = stack.decode_batch([(step, padded, [n + 1 for n in lengths])])[0]  # one padded session alone
    torch.testing.assert_close(alone, masked_inference_step(stack, step, torch.cat([full, full[:, -1:]], 1), apart, 8),
                               atol=ATOL, rtol=0)


def test_rollback_of_a_padded_session_recomputes_each_row_length():
    stack = make_stack(FAMILY_CONFIGS["llama"])
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(1, n, 64, generator=gen) for n in LENGTHS]
    hidden, mask = left_padded(rows)
    cache = stack.allocate_cache(3, 16, 0, 2)
    masked_inference_step(stack, hidden, mask, cache, 0)
    step = torch.randn(3, 1, 64, generator=gen)
    full = torch.cat([mask, torch.ones(3, 1, dtype=torch.bool)], dim=1)
    first = masked_inference_step(stack, step, full, cache, 7)
    masked_inference_step(stack, torch.randn(3, 1, 64, generator=gen), torch.cat([full, torch.ones(3, 1, dtype=torch.bool)], 1),
                          cache, 8)
    again = masked_inference_step(stack, step, full, cache, 7)  # rolled back to position 7
    torch.testing.assert_close(again, first, atol=0, rtol=0)


def test_reordered_cache_continues_the_chosen_rows():
    stack = make_stack(FAMILY_CONFIGS["qwen3"])
    gen = torch.Generator().manual_seed(4)
    prompt, step = torch.randn(3, 4, 64, generator=gen), torch.randn(3, 1, 64, generator=gen)
    cache = stack.allocate_cache(3, 16, 0, 2)
    stack.inference_step(prompt, cache, 0)
    hypo_ids = [2, 0, 0]
    cache.reorder(hypo_ids, 4)
    got = stack.inference_step(step, cache, 4)
    fresh = stack.allocate_cache(3, 16, 0, 2)
    stack.inference_step(prompt[hypo_ids], fresh, 0)
    torch.testing.assert_close(got, stack.inference_step(step, fresh, 4), atol=ATOL, rtol=0)


def test_bad_hypo_ids_and_masks_are_named():
    assert check_hypo_ids([0, 1], 2) is None
    assert "out of range" in check_hypo_ids([0, 2], 2)
    assert "entries" in check_hypo_ids([0], 2)
    assert check_mask(torch.ones(2, 3, dtype=torch.bool), 2, 3) is None
    assert "shape" in check_mask(torch.ones(2, 4, dtype=torch.bool), 2, 3)
    assert "0 and 1" in check_mask(torch.full((2, 3), 2), 2, 3)
    assert "bool or integer" in check_mask(torch.ones(2, 3), 2, 3)
