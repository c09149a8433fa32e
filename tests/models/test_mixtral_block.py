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
from safetensors.torch import load_file
from torch import Tensor
from transformers import AutoModelForCausalLM, MixtralConfig

from corolla.models import ModelFamily, get_family
from corolla.models.llama import LlamaClientHead
from corolla.models.mixtral import MixtralBlock, kv_layout
from corolla.models.mixtral.block import MixtralExperts

ATOL = 1e-5
VOCAB = 128
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


def make_reference(config: MixtralConfig, seed: int = 0) -> torch.nn.Module:
    """HF model with eager attention and experts, eval, float32, weights N(0, 0.1), norm weights near 1."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    model.eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
    return model


def block_state(state: dict[str, Tensor], family: ModelFamily, index: int) -> dict[str, Tensor]:
    """Block ``index``'s tensors of a full checkpoint, with the block prefix stripped."""
    prefix = family.block_prefix(index)
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def load_ours(config: MixtralConfig, state: dict[str, Tensor]) -> tuple[list[MixtralBlock], LlamaClientHead]:
    """Our blocks and head, loaded from a checkpoint under its full names through the registry."""
    family = get_family(config)
    blocks = []
    for i in range(family.num_blocks(config)):
        block = family.block_class(config, i)
        block.load_hf_state_dict(block_state(state, family, i))
        blocks.append(block.eval())
    head = family.head_class(config)
    head.load_hf_state_dict({k: v for k, v in state.items() if family.is_head_tensor(k)})
    return blocks, head.eval()


@functools.cache
def case(case_id: str) -> tuple[torch.nn.Module, list[MixtralBlock], LlamaClientHead]:
    model = make_reference(make_config(**CASES[case_id]))
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


def token_ids(batch: int = 2, length: int = 15, seed: int = 1) -> Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def make_cache(config: MixtralConfig, batch: int, s_max: int) -> list[tuple[Tensor, Tensor]]:
    n_kv_heads, head_dim = kv_layout(config)
    return [(torch.zeros(batch, n_kv_heads, s_max, head_dim), torch.zeros(batch, n_kv_heads, s_max, head_dim))
            for _ in range(config.num_hidden_layers)]


def run_stack(blocks: list[MixtralBlock], head: LlamaClientHead, ids: Tensor, *, position: int = 0,
              caches: list[tuple[Tensor, Tensor]] | None = None) -> Tensor:
    hidden = head.embed(ids)
    for i, block in enumerate(blocks):
        hidden = block(hidden, caches[i] if caches is not None else None, position)
    return head.logits(hidden)


@pytest.mark.parametrize("case_id", list(CASES))
@torch.no_grad()
def test_each_block_matches_its_hf_decoder_layer(case_id: str) -> None:
    model, blocks, head = case(case_id)
    layer_outputs: list[Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _a, out: layer_outputs.append(out)) for layer in model.model.layers]
    ids = token_ids()
    model(ids)
    for hook in hooks:
        hook.remove()
    inputs = [head.embed(ids), *layer_outputs[:-1]]
    for i, block in enumerate(blocks):
        torch.testing.assert_close(block(inputs[i]), layer_outputs[i], atol=ATOL, rtol=0, msg=f"layer {i}")


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
    ids = token_ids(length=15)
    expected = model(ids).logits  # (B, 15, V)
    caches = make_cache(model.config, batch=2, s_max=32)
    chunks = [(0, 7), *[(t, t + 1) for t in range(7, 12)], (12, 15)]  # prefill 7, five single steps, a 3-token chunk
    for start, end in chunks:
        got = run_stack(blocks, head, ids[:, start:end], position=start, caches=caches)
        torch.testing.assert_close(got, expected[:, start:end], atol=ATOL, rtol=0, msg=f"tokens [{start}, {end})")


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
    state = block_state(saved_checkpoint("4experts-top2", saved_dir), get_family(model.config), 0)
    state.pop("block_sparse_moe.experts.3.w3.weight")
    state["block_sparse_moe.experts.4.w1.weight"] = torch.zeros(INNER, 64)  # only 4 experts: 0..3
    block = MixtralBlock(model.config, 0)
    before = {k: v.clone() for k, v in block.state_dict().items()}
    expected = (r"missing keys \['block_sparse_moe.experts.3.w3.weight'\], "
                r"unexpected keys \['block_sparse_moe.experts.4.w1.weight'\]")
    with pytest.raises(ValueError, match=expected):
        block.load_hf_state_dict(state)
    assert all(torch.equal(v, before[k]) for k, v in block.state_dict().items())


def test_block_load_rejects_mixed_layouts_and_wrong_shapes() -> None:
    model, _, _ = case("4experts-top2")
    fused = block_state(model.state_dict(), get_family(model.config), 0)
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
    model_bf16 = make_reference(model.config).to(torch.bfloat16)
    blocks, head = load_ours(model_bf16.config, model_bf16.state_dict())
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
