"""The generic backend against transformers itself: for every model type of ``generic_cases``, our generic blocks
(the installed transformers' own decoder layers on our caches) and client head give HF's layer outputs and logits:
layer by layer, the whole sequence, cached decoding in chunks, sliding-window layers on ring caches past their
window, a later start position, bfloat16, gradients, and batched decode of sessions at different lengths."""

from __future__ import annotations

import pytest
import torch
from generic_cases import CASES, REQUIRED, WINDOW, case_config, generic_case, one_thread, with_dtype  # noqa: F401
from reference import (
    ATOL,
    DECODE_CHUNKS,
    assert_blocks_match_hf_layers,
    assert_decode_steps_match_full_sequence,
    run_stack,
    token_ids,
)
from torch import Tensor, nn

from corolla.models import get_family
from corolla.models.generic import GenericBlock, GenericClientHead, cache_length, ring_slots
from corolla.server.compute.forward_backward import backward_through

pytestmark = pytest.mark.usefixtures("one_thread")
SLIDING = ["qwen3_moe-window4", "gemma2", "gemma3_text", "phi3-window4", "cohere2", "gpt_oss", "olmo3", "exaone4"]


def caches_for(blocks: list[GenericBlock], batch: int, max_length: int,
               dtype: torch.dtype = torch.float32) -> list[tuple[Tensor, Tensor]]:
    """Zeroed caches as a server allocates them: ``cache_length`` slots per block (rings for sliding layers)."""
    caches = []
    for block in blocks:
        shape = (batch, block.n_kv_heads, cache_length(block.window, block.head_dim, max_length), block.head_dim)
        caches.append((torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)))
    return caches


def test_every_case_runs_on_the_generic_backend_with_the_models_own_layer_class() -> None:
    for case_id in CASES:
        config = case_config(case_id)
        family = get_family(config)
        assert family.name == "generic" and family.block_class is GenericBlock and family.head_class is GenericClientHead
    reference, blocks, _ = generic_case("gemma3_text")
    assert type(blocks[0].layer) is type(reference.model.layers[0])


@pytest.mark.parametrize("case_id", list(REQUIRED))
@torch.no_grad()
def test_each_generic_block_matches_its_hf_layer(case_id: str) -> None:
    reference, blocks, head = generic_case(case_id)
    assert_blocks_match_hf_layers(reference, reference.model.layers, blocks, head)


@pytest.mark.parametrize("case_id", list(CASES))
@torch.no_grad()
def test_generic_stack_logits_match_hf_full_sequence(case_id: str) -> None:
    reference, blocks, head = generic_case(case_id)
    ids = token_ids()
    torch.testing.assert_close(run_stack(blocks, head, ids), reference(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case_id", list(CASES))
@torch.no_grad()
def test_generic_decode_steps_match_full_sequence(case_id: str) -> None:
    """Prefill 7, five single steps, a 3-token chunk, through full-length caches."""
    reference, blocks, head = generic_case(case_id)
    assert_decode_steps_match_full_sequence(reference, blocks, head, caches_for(blocks, batch=2, max_length=32))


@pytest.mark.parametrize("case_id", SLIDING)
@torch.no_grad()
def test_sliding_layers_on_rings_match_hf_far_past_their_window(case_id: str) -> None:
    """A 40-token session: sliding layers keep 2 x window slots (+1 of bookkeeping), not 40, and every step, chunks
    longer than the ring included, still gives HF's logits."""
    reference, blocks, head = generic_case(case_id)
    caches = caches_for(blocks, batch=2, max_length=40)
    lengths = [c[0].shape[2] for c in caches]
    assert lengths == [ring_slots(WINDOW) + 1 if b.window else 40 for b in blocks] and min(lengths) < 40
    ids = token_ids(length=40)
    expected = reference(ids).logits
    chunks = [(0, 3), (3, 16), (16, 17), (17, 18), *((t, t + 1) for t in range(18, 30)), (30, 40)]
    for start, end in chunks:
        got = run_stack(blocks, head, ids[:, start:end], position=start, caches=caches)
        torch.testing.assert_close(got, expected[:, start:end], atol=ATOL, rtol=0,
                                   msg=lambda m: f"tokens [{start}, {end}): {m}")


@pytest.mark.parametrize("case_id", ["gemma2", "gpt_oss"])
@torch.no_grad()
def test_a_shallow_rollback_on_a_ring_recomputes_exactly_and_a_deep_one_is_refused(case_id: str) -> None:
    reference, blocks, head = generic_case(case_id)
    caches = caches_for(blocks, batch=2, max_length=40)
    ids = token_ids(length=30)
    expected = reference(ids).logits
    run_stack(blocks, head, ids[:, :30], caches=caches)
    back = 30 - (ring_slots(WINDOW) - WINDOW + 1)  # the deepest rollback the ring serves
    got = run_stack(blocks, head, ids[:, back:30], position=back, caches=caches)
    torch.testing.assert_close(got, expected[:, back:30], atol=ATOL, rtol=0)
    before = [c[0].clone() for c in caches]
    with pytest.raises(ValueError, match="has dropped those below"):
        run_stack(blocks, head, ids[:, 10:12], position=10, caches=caches)
    assert all(torch.equal(b, c[0]) for b, c in zip(before, caches)), "a refused step wrote to the cache"


@pytest.mark.parametrize("case_id", ["qwen3_moe", "gemma3_text", "phi3", "granite", "gpt_oss"])
@torch.no_grad()
def test_generic_stack_without_cache_at_a_later_position_matches_hf_there(case_id: str) -> None:
    reference, blocks, head = generic_case(case_id)
    ids = token_ids(length=6)
    expected = reference(ids, position_ids=torch.arange(5, 11)[None].expand(2, -1)).logits
    torch.testing.assert_close(run_stack(blocks, head, ids, position=5), expected, atol=ATOL, rtol=0)


def routers(layers: list[nn.Module]) -> list[nn.Module]:
    """The top-k expert routers of the decoder layers that have one (mixture-of-experts MLPs), in layer order."""
    return [layer.mlp.gate for layer in layers if hasattr(getattr(layer, "mlp", None), "gate")
            and hasattr(layer.mlp.gate, "top_k")]


class ExpertChoices:
    """The experts an oracle run picked, token by token, and hooks that make other runs' routers pick them too.

    In bfloat16 a router whose top-k is a near tie picks by rounding, and rounding differs between CPUs (their bf16
    kernels differ): one flipped expert moves a token's logits by ~0.4, far past any bf16 tolerance, although
    neither side is wrong. Forcing both sides onto the oracle's experts (each still weighting them by its own
    probabilities) keeps everything else compared: attention, norms, the experts' own math, the cache.
    """

    def __init__(self, oracle: nn.Module, ids: Tensor) -> None:
        self.chosen: list[Tensor] = []  # per router, in layer order: (B, T, top_k) expert ids the oracle picked
        handles = [r.register_forward_hook(self._record) for r in routers(list(oracle.model.layers))]
        try:
            oracle(ids)
        finally:
            for handle in handles:
                handle.remove()
        self.batch = ids.shape[0]
        self.window = (0, ids.shape[1])  # the positions [a, b) the next forced run covers

    def _record(self, module: nn.Module, inputs: tuple, output: tuple) -> None:
        self.chosen.append(output[2])  # (B x T, top_k), batch-major; reshaped once the batch is known

    def force(self, routers_: list[nn.Module]) -> list:
        """Forward hooks on `routers_` (in layer order) that replace each one's choice by the oracle's for the
        positions `self.window`; the caller removes them."""
        return [r.register_forward_hook(self._forcer(i)) for i, r in enumerate(routers_)]

    def _forcer(self, index: int):
        def hook(module: nn.Module, inputs: tuple, output: tuple) -> tuple:
            logits = output[0]  # (B x (b - a), n_experts), batch-major
            start, end = self.window
            chosen = self.chosen[index].reshape(self.batch, -1, module.top_k)[:, start:end].reshape(-1, module.top_k)
            if chosen.shape[0] != logits.shape[0]:
                raise AssertionError(f"router saw {logits.shape[0]} rows, the oracle {chosen.shape[0]} for {self.window}")
            weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, chosen)
            if getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen
        return hook


@pytest.mark.parametrize("case_id", ["qwen3_moe", "gemma2", "gemma3_text", "cohere2"])
@torch.no_grad()
def test_generic_stack_in_bfloat16_stays_close_to_hf_in_bfloat16(case_id: str) -> None:
    """Mixture-of-experts cases route every bfloat16 run (ours, HF's) as the float32 HF model routes (see
    ExpertChoices): the comparison holds on any CPU, whatever its bf16 kernels round."""
    ids = token_ids()
    choices = ExpertChoices(generic_case(case_id)[0], ids)  # the float32 HF model's experts
    reference, blocks, head = with_dtype(case_id, torch.bfloat16)
    hooks = [*choices.force(routers(list(reference.model.layers))), *choices.force(routers([b.layer for b in blocks]))]
    try:
        expected = reference(ids).logits.float()
        got = run_stack(blocks, head, ids)
        assert got.dtype == torch.bfloat16
        caches = caches_for(blocks, batch=2, max_length=16, dtype=torch.bfloat16)
        chunks = []
        for a, b in DECODE_CHUNKS:
            choices.window = (a, b)
            chunks.append(run_stack(blocks, head, ids[:, a:b], position=a, caches=caches))
        stepped = torch.cat(chunks, 1)
    finally:
        for hook in hooks:
            hook.remove()
    assert bool(choices.chosen) == (case_id == "qwen3_moe")  # the hooks did reach the MoE case's routers
    torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=0.05)
    torch.testing.assert_close(stepped.float(), expected, atol=0.1, rtol=0.05)


def _hf_embedding_gradient(reference: nn.Module, head: nn.Module, ids: Tensor, weights: Tensor) -> Tensor:
    embeds = head.embed(ids).detach().requires_grad_(True)  # the first block's input, as our client computes it
    scale = head.spec.embedding_multiplier or 1.0  # HF multiplies inputs_embeds by it itself
    logits = reference(inputs_embeds=embeds / scale).logits
    (grad,) = torch.autograd.grad((logits * weights).sum(), embeds)
    return grad


@pytest.mark.parametrize("case_id", ["qwen3_moe", "gemma2", "granite", "gpt_oss"])
def test_gradient_through_generic_blocks_matches_hf_autograd(case_id: str) -> None:
    """rpc_backward's math (server.compute.forward_backward.backward_through) over the generic blocks, against autograd through HF."""
    reference, blocks, head = generic_case(case_id)
    ids = token_ids(length=9)
    weights = torch.randn(2, 9, reference.config.vocab_size, generator=torch.Generator().manual_seed(3))
    expected = _hf_embedding_gradient(reference, head, ids, weights)
    with torch.no_grad():
        hidden = head.embed(ids)
        out = hidden
        for block in blocks:
            out = block(out)
    final = out.detach().requires_grad_(True)
    (grad_out,) = torch.autograd.grad((head.logits(final) * weights).sum(), final)
    grad_in, _ = backward_through(blocks, hidden, grad_out)
    torch.testing.assert_close(grad_in, expected, atol=1e-4, rtol=1e-4)
    assert all(p.grad is None for b in blocks for p in b.parameters())


@pytest.mark.parametrize("case_id", ["qwen3_moe", "gemma3_text", "gpt_oss", "phi3-window4"])
@torch.no_grad()
def test_ragged_decode_of_sessions_at_different_lengths_matches_each_alone(case_id: str) -> None:
    """Continuous batching: rows of three sessions (lengths 3, 11, 20: one before the window fills on full-length
    caches, two past it on ring caches) decode together through ``RaggedKV`` and match HF on each sequence."""
    from corolla.models.ragged import RaggedKV

    reference, blocks, head = generic_case(case_id)
    ids = token_ids(batch=3, length=26)
    expected = reference(ids).logits
    lengths, max_lengths = [3, 11, 20], [8, 32, 26]  # > 2 x window + 1 slots: the sliding layers keep a ring
    sessions = [caches_for(blocks, batch=1, max_length=m) for m in max_lengths]
    for row, (n, caches) in enumerate(zip(lengths, sessions)):
        run_stack(blocks, head, ids[row : row + 1, :n], caches=caches)
    positions = list(lengths)
    for _ in range(5):
        hidden = head.embed(torch.stack([ids[row, p] for row, p in enumerate(positions)])[:, None])  # (3, 1, H)
        for j, block in enumerate(blocks):
            hidden = block(hidden, RaggedKV([caches[j] for caches in sessions], positions), 0)
        got = head.logits(hidden)[:, 0]
        want = torch.stack([expected[row, p] for row, p in enumerate(positions)])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        positions = [p + 1 for p in positions]


def test_registry_lists_exactly_the_tested_model_types_as_verified() -> None:
    from corolla.models.registry import GENERIC_VERIFIED

    assert set(GENERIC_VERIFIED) == {str(kwargs["model_type"]) for kwargs in CASES.values()}
