"""Continuous batching: one ragged step over several sessions equals stepping each session alone, for every family."""

from __future__ import annotations

import pytest
import torch
from reference import FAMILY_CONFIGS, load_blocks, make_caches, run_blocks
from transformers import (
    AutoModelForCausalLM,
)

from corolla.models import get_family
from corolla.models.ragged import RaggedKV

PROMPT_LENGTHS = (5, 1, 9)  # three sessions at different positions


def blocks_of(config) -> list[torch.nn.Module]:
    """Our blocks with HF's own random init (``initializer_range=0.1``), loaded through the registry."""
    torch.manual_seed(0)
    return load_blocks(config, AutoModelForCausalLM.from_config(config).eval().state_dict())


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
@torch.no_grad()
def test_ragged_step_equals_each_session_alone(name):
    config = FAMILY_CONFIGS[name]
    blocks = blocks_of(config)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randn(1, n, 64, generator=gen) for n in PROMPT_LENGTHS]
    tokens = torch.randn(len(prompts), 1, 64, generator=gen)  # the next token of each session

    alone, batched_caches = [], []
    for prompt, token in zip(prompts, tokens):
        cache = make_caches(config, 1, s_max=16)
        run_blocks(blocks, prompt, cache, 0)
        batched_caches.append([(k.clone(), v.clone()) for k, v in cache])
        alone.append(run_blocks(blocks, token[None], cache, prompt.shape[1]))

    x = tokens
    for j, block in enumerate(blocks):
        ragged = RaggedKV([c[j] for c in batched_caches], [p.shape[1] for p in prompts])
        x = block(x, ragged, 0)
    torch.testing.assert_close(x, torch.cat(alone), atol=1e-5, rtol=0)
    # the new keys/values landed in each session's own cache, where the next step finds them
    n = PROMPT_LENGTHS[0]
    solo_cache = make_caches(config, 1, s_max=16)
    run_blocks(blocks, torch.cat([prompts[0], tokens[:1]], dim=1), solo_cache, 0)
    torch.testing.assert_close(batched_caches[0][1][0][:, :, : n + 1], solo_cache[1][0][:, :, : n + 1], atol=1e-5, rtol=0)


def test_ragged_rows_of_one_session_with_batch_two_write_their_own_rows():
    config = FAMILY_CONFIGS["llama"]
    blocks = blocks_of(config)
    gen = torch.Generator().manual_seed(2)
    prompt, token = torch.randn(2, 4, 64, generator=gen), torch.randn(2, 1, 64, generator=gen)
    cache = make_caches(config, 2, s_max=16)
    run_blocks(blocks, prompt, cache, 0)
    batched = [(k.clone(), v.clone()) for k, v in cache]
    expected = run_blocks(blocks, token, cache, 4)
    x = token
    for j, block in enumerate(blocks):
        k, v = batched[j]
        x = block(x, RaggedKV([(k[0:1], v[0:1]), (k[1:2], v[1:2])], [4, 4]), 0)
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(batched[1][0], cache[1][0], atol=1e-5, rtol=0)


def test_ragged_rejects_negative_positions_and_attend_rejects_positions_outside_the_cache():
    k = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=">= 0"):
        RaggedKV([(k, k)], [-1])
    step = torch.zeros(1, 2, 1, 8)  # (B, heads, 1, D)
    with pytest.raises(ValueError, match="outside a cache of length 4"):
        RaggedKV([(k, k)], [4]).attend(step, step, step, scale=1.0)


@torch.no_grad()
def test_server_decode_batch_equals_each_step_alone():
    from corolla.server.compute.block_stack import BlockStack, KVLayout

    config = FAMILY_CONFIGS["qwen3"]
    stack = BlockStack(blocks_of(config), 0, 64, KVLayout(*get_family(config).kv_layout(config)), torch.float32,
                       torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    sessions = []
    for batch, length in ((1, 3), (2, 6), (1, 1)):
        cache = stack.allocate_cache(batch, 16, 0, 2)
        stack.inference_step(torch.randn(batch, length, 64, generator=gen), cache, 0)
        sessions.append((torch.randn(batch, 1, 64, generator=gen), cache, length))
    copies = [type(cache)(cache.start, [((k.clone(), v.clone()),) for k, v in cache.pairs()]) for _, cache, _ in sessions]
    batched = stack.decode_batch([(h, cache, pos) for h, cache, pos in sessions])
    for (hidden, _, position), cache, out in zip(sessions, copies, batched):
        torch.testing.assert_close(out, stack.inference_step(hidden, cache, position), atol=1e-5, rtol=0)
