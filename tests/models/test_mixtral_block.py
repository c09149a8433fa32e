"""The Mixtral block (Llama attention + sparse MoE) against the Hugging Face reference.

Tiny random models are built in memory (no downloads), with eager attention and HF's eager expert loop;
weights are re-drawn larger than HF's init so that attention is far from uniform and routing is far from
even, so a wrong router, gate/up split or expert weighting shows up in the logits.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from reference import (
    ATOL,
    VOCAB,
    assert_bfloat16_close_to_hf,
    assert_blocks_match_hf_layers,
    assert_decode_steps_match_full_sequence,
    assert_unchanged,
    load_ours,
    make_caches,
    make_reference,
    run_stack,
    token_ids,
)
from safetensors.torch import load_file
from torch import Tensor
from transformers import MixtralConfig

from corolla.models import ModelFamily, get_family
from corolla.models.llama import LlamaClientHead
from corolla.models.mixtral import MixtralBlock
from corolla.models.mixtral.block import MixtralExperts

N_EXPERTS = 4
INNER = 48

# case id -> config overrides
CASES: dict[str, dict] = {
    "4experts-top2": {},
    "4experts-top1": {"num_experts_per_tok": 1},
    "4experts-top2-window4": {"sliding_window": 4},
}


def make_config(**overrides: object) -> MixtralConfig:
    """A 3-layer GQA Mixtral (4 query heads, 2 kv heads, hidden 64, 4 experts of 48, top-2, vocab 128)."""
    base: dict[str, object] = {
        "hidden_size": 64, "intermediate_size": INNER, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 3, "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "num_local_experts": N_EXPERTS, "num_experts_per_tok": 2,
    }
    return MixtralConfig(**{**base, **overrides})


@functools.cache
def case(case_id: str) -> tuple[torch.nn.Module, list[MixtralBlock], LlamaClientHead]:
    model = make_reference(make_config(**CASES[case_id]), experts_implementation="eager")
    return (model, *load_ours(model.config, model.state_dict()))


@functools.cache
def saved_checkpoint(case_id: str, directory: Path) -> dict[str, Tensor]:
    """What ``save_pretrained`` writes for ``case_id``'s reference model, read back as a flat dict."""
    model, _, _ = case(case_id)
    model.save_pretrained(directory)
    return load_file(directory / "model.safetensors")


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mixtral")


@pytest.mark.parametrize("case_id", list(CASES))
@torch.no_grad()
def test_each_block_matches_its_hf_decoder_layer(case_id: str) -> None:
    model, blocks, head = case(case_id)
    assert_blocks_match_hf_layers(model, model.model.layers, blocks, head)


@pytest.mark.parametrize("case_id", list(CASES))
@torch.no_grad()
def test_router_picks_hf_experts_with_hf_weights(case_id: str) -> None:
    model, blocks, _ = case(case_id)
    x = torch.randn(30, 64, generator=torch.Generator().manual_seed(2))
    _, hf_weights, hf_experts = model.model.layers[0].mlp.gate(x)
    weights, experts = blocks[0].mlp.route(x)
    assert weights.dtype == torch.float32
    assert torch.equal(experts, hf_experts)
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(30), atol=1e-6, rtol=0)


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
    assert_decode_steps_match_full_sequence(model, blocks, head, make_caches(model.config, batch=2, s_max=32))


@torch.no_grad()
def test_block_without_cache_starts_rotary_at_given_position() -> None:
    model, blocks, head = case("4experts-top2-window4")
    ids = token_ids(length=6)
    expected = model(ids, position_ids=torch.arange(5, 11)[None].expand(2, -1)).logits
    torch.testing.assert_close(run_stack(blocks, head, ids, position=5), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("top_k", [1, 2])
@torch.no_grad()
def test_decode_step_runs_only_the_chosen_experts(top_k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _, blocks, _ = case("4experts-top2" if top_k == 2 else "4experts-top1")
    moe = blocks[0].mlp
    x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(3))
    _, chosen = moe.route(x.view(1, 64))
    calls: list[int] = []
    original = MixtralExperts.forward
    monkeypatch.setattr(MixtralExperts, "forward", lambda self, h, e: calls.append(e) or original(self, h, e))
    moe(x)
    assert calls == sorted(chosen[0].tolist())


def test_save_pretrained_writes_the_per_expert_hub_layout(saved_dir: Path) -> None:
    saved = saved_checkpoint("4experts-top2", saved_dir)
    layer0 = {k for k in saved if k.startswith("model.layers.0.")}
    moe = {k for k in layer0 if "block_sparse_moe" in k}
    assert moe == {"model.layers.0.block_sparse_moe.gate.weight"} | {
        f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in range(N_EXPERTS) for w in ("w1", "w2", "w3")
    }
    assert not any(".mlp." in k for k in saved)
    assert saved["model.layers.0.block_sparse_moe.experts.1.w1.weight"].shape == (INNER, 64)
    assert saved["model.layers.0.block_sparse_moe.experts.1.w2.weight"].shape == (64, INNER)


@torch.no_grad()
def test_per_expert_and_fused_checkpoints_load_identically(saved_dir: Path) -> None:
    model, fused_blocks, fused_head = case("4experts-top2")
    saved = saved_checkpoint("4experts-top2", saved_dir)
    blocks, head = load_ours(model.config, saved)
    for fused, per_expert in zip(fused_blocks, blocks):
        for (name, a), (_, b) in zip(fused.state_dict().items(), per_expert.state_dict().items()):
            assert torch.equal(a, b), name
    # the fused names are HF's in-memory names: gate = w1 is the first half of gate_up_proj, up = w3 the second
    gate_up = model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(gate_up[2, :INNER], saved["model.layers.1.block_sparse_moe.experts.2.w1.weight"])
    assert torch.equal(gate_up[2, INNER:], saved["model.layers.1.block_sparse_moe.experts.2.w3.weight"])
    ids = token_ids()
    torch.testing.assert_close(run_stack(blocks, head, ids), run_stack(fused_blocks, fused_head, ids), atol=0, rtol=0)
    torch.testing.assert_close(run_stack(blocks, head, ids), model(ids).logits, atol=ATOL, rtol=0)


def test_block_load_names_missing_and_unexpected_per_expert_keys(saved_dir: Path) -> None:
    model, _, _ = case("4experts-top2")
    state = get_family(model.config).block_tensors(saved_checkpoint("4experts-top2", saved_dir), 0)
    state.pop("block_sparse_moe.experts.3.w3.weight")
    state["block_sparse_moe.experts.4.w1.weight"] = torch.zeros(INNER, 64)  # only 4 experts: 0..3
    block = MixtralBlock(model.config, 0)
    expected = (r"missing keys \['block_sparse_moe.experts.3.w3.weight'\], "
                r"unexpected keys \['block_sparse_moe.experts.4.w1.weight'\]")
    with assert_unchanged(block), pytest.raises(ValueError, match=expected):
        block.load_hf_state_dict(state)


def test_block_load_rejects_mixed_layouts_and_wrong_shapes() -> None:
    model, _, _ = case("4experts-top2")
    fused = get_family(model.config).block_tensors(model.state_dict(), 0)
    block = MixtralBlock(model.config, 0)
    mixed = {**fused, "block_sparse_moe.gate.weight": fused["mlp.gate.weight"]}
    with pytest.raises(ValueError, match=r"unexpected keys \[.*'mlp.experts.down_proj'.*per-expert"):
        block.load_hf_state_dict(mixed)
    no_router = {k: v for k, v in fused.items() if k != "mlp.gate.weight"}
    with pytest.raises(ValueError, match=r"missing keys \['mlp.gate.weight'\], unexpected keys \[\]"):
        block.load_hf_state_dict(no_router)
    swapped = {**fused, "mlp.experts.down_proj": fused["mlp.experts.down_proj"].transpose(1, 2)}
    with pytest.raises(ValueError, match=r"mlp.experts.down_proj has shape \(4, 48, 64\), expected \(4, 64, 48\)"):
        block.load_hf_state_dict(swapped)


def test_get_family_serves_mixtral_with_the_llama_head() -> None:
    config = make_config()
    family = get_family(config)
    assert isinstance(family, ModelFamily) and family.name == "mixtral"
    assert family.block_class is MixtralBlock and family.head_class is LlamaClientHead
    assert family.block_prefix(3) == "model.layers.3."
    assert family.num_blocks(config) == 3
    assert family.kv_layout(config) == (2, 16)
    assert family.is_head_tensor("lm_head.weight")
    assert not family.is_head_tensor("model.layers.0.block_sparse_moe.experts.0.w1.weight")


@torch.no_grad()
def test_block_runs_in_bfloat16_close_to_hf_bfloat16() -> None:
    model, _, _ = case("4experts-top2")
    assert_bfloat16_close_to_hf(make_reference(model.config, experts_implementation="eager").to(torch.bfloat16))
