"""What is specific to Mixtral (Llama attention + sparse MoE): the router, running only the chosen experts, and
the per-expert hub layout next to HF's fused in-memory layout.

HF runs its eager expert loop; weights are re-drawn larger than HF's init so that routing is far from even and
a wrong router, gate/up split or expert weighting shows up in the logits. The checks every family shares
(blocks, stack, decoding, bfloat16, head, registry) are in ``test_family_blocks.py``; the cases are in
``block_cases.py``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from block_cases import CASES, case
from block_cases import MIXTRAL_EXPERTS as N_EXPERTS
from block_cases import MIXTRAL_INNER as INNER
from reference import ATOL, assert_unchanged, load_ours, run_stack, token_ids
from safetensors.torch import load_file
from torch import Tensor

from corolla.models import get_family
from corolla.models.mixtral import MixtralBlock
from corolla.models.mixtral.block import MixtralExperts


@functools.cache
def saved_checkpoint(case_id: str, directory: Path) -> dict[str, Tensor]:
    """What ``save_pretrained`` writes for ``case_id``'s reference model, read back as a flat dict."""
    model, _, _ = case(case_id)
    model.save_pretrained(directory)
    return load_file(directory / "model.safetensors")


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mixtral")


@pytest.mark.parametrize("case_id", [case_id for case_id in CASES if case_id.startswith("mixtral")])
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


@pytest.mark.parametrize("top_k", [1, 2])
@torch.no_grad()
def test_decode_step_runs_only_the_chosen_experts(top_k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _, blocks, _ = case("mixtral-4experts-top2" if top_k == 2 else "mixtral-4experts-top1")
    moe = blocks[0].mlp
    x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(3))
    _, chosen = moe.route(x.view(1, 64))
    calls: list[int] = []
    original = MixtralExperts.forward
    monkeypatch.setattr(MixtralExperts, "forward", lambda self, h, e: calls.append(e) or original(self, h, e))
    moe(x)
    assert calls == sorted(chosen[0].tolist())


def test_save_pretrained_writes_the_per_expert_hub_layout(saved_dir: Path) -> None:
    saved = saved_checkpoint("mixtral-4experts-top2", saved_dir)
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
    model, fused_blocks, fused_head = case("mixtral-4experts-top2")
    saved = saved_checkpoint("mixtral-4experts-top2", saved_dir)
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
    model, _, _ = case("mixtral-4experts-top2")
    state = get_family(model.config).block_tensors(saved_checkpoint("mixtral-4experts-top2", saved_dir), 0)
    state.pop("block_sparse_moe.experts.3.w3.weight")
    state["block_sparse_moe.experts.4.w1.weight"] = torch.zeros(INNER, 64)  # only 4 experts: 0..3
    block = MixtralBlock(model.config, 0)
    expected = (r"missing keys \['block_sparse_moe.experts.3.w3.weight'\], "
                r"unexpected keys \['block_sparse_moe.experts.4.w1.weight'\]")
    with assert_unchanged(block), pytest.raises(ValueError, match=expected):
        block.load_hf_state_dict(state)


def test_block_load_rejects_mixed_layouts_and_wrong_shapes() -> None:
    model, _, _ = case("mixtral-4experts-top2")
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
