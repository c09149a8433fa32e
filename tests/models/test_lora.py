"""LoRA adapters saved by peft, attached to our blocks, against peft's own model (the oracle).

Each case builds a tiny HF model, wraps it with ``peft.get_peft_model``, draws random nonzero ``lora_B``
weights (peft initialises B to zero, which would make every adapter a no-op) and ``save_pretrained``s the
adapter; our blocks load the base weights and the adapter through ``corolla.server.loading.adapters``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FakeHub
from peft import LoraConfig, get_peft_model
from reference import ATOL, load_ours, make_caches, make_reference, run_stack, token_ids
from torch import nn
from transformers import (
    BloomConfig,
    FalconConfig,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen3Config,
)

from corolla.models import get_family
from corolla.models.lora import LoraLinear, using_adapter
from corolla.server.loading.adapters import attach_adapters, load_lora_adapter

TINY = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_hidden_layers=3, max_position_embeddings=64)
# Whole-stack logits (3 blocks and the head, with updates up to 8x scaled) accumulate more float32 rounding than
# one block: they are compared at the swarm's tolerance, single blocks at ATOL.
LOGITS_ATOL = 1e-4
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama_config(**overrides: object) -> PretrainedConfig:
    return LlamaConfig(**{**TINY, "intermediate_size": 128, "num_key_value_heads": 2, **overrides})


CONFIGS: dict[str, tuple[PretrainedConfig, list[str]]] = {
    "llama": (llama_config(), LLAMA_TARGETS),
    "qwen3-biases": (Qwen3Config(**{**TINY, "intermediate_size": 128, "num_key_value_heads": 2, "head_dim": 16,
                                    "attention_bias": True}), LLAMA_TARGETS),
    "mixtral-attention": (MixtralConfig(**{**TINY, "intermediate_size": 64, "num_key_value_heads": 2,
                                                      "num_local_experts": 4, "num_experts_per_tok": 2}),
                                     ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "bloom-fused-qkv": (BloomConfig(vocab_size=128, hidden_size=64, n_head=4, n_layer=3),
                        ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
    "falcon-40b-layout": (FalconConfig(vocab_size=128, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                                       num_hidden_layers=3, new_decoder_architecture=True, bias=False),
                          ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
}


def base_model(config: PretrainedConfig, seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The HF reference (eager, float32) and a copy of its own state dict (before peft renames its modules)."""
    norms = ("norm.weight", "layernorm.weight", "ln_attn.weight", "ln_mlp.weight", "ln_f.weight")
    model = make_reference(config, seed, norms=norms, **({"experts_implementation": "eager"} if config.model_type == "mixtral" else {}))
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def save_adapter(model: nn.Module, directory: Path, seed: int = 1, **lora: object) -> nn.Module:
    """Wrap ``model`` with a peft LoRA adapter of random nonzero weights, save it to ``directory``; the peft model."""
    peft_model = get_peft_model(model, LoraConfig(**lora))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.normal_(0.0, 0.2)
    peft_model.eval().save_pretrained(directory)
    return peft_model


def decoder_layers(peft_model: nn.Module) -> nn.ModuleList:
    inner = peft_model.base_model.model
    return inner.transformer.h if hasattr(inner, "transformer") else inner.model.layers


def layer_io(peft_model: nn.Module, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) hidden states of every decoder layer while the peft model runs on ``ids``."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(_module, args, kwargs, out):
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.append((hidden, out[0] if isinstance(out, tuple) else out))

    hooks = [layer.register_forward_hook(hook, with_kwargs=True) for layer in decoder_layers(peft_model)]
    try:
        with torch.no_grad():
            peft_model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def ours_with_adapters(config: PretrainedConfig, state: dict[str, torch.Tensor], adapters: list[str]) -> tuple[list[nn.Module], nn.Module]:
    blocks, head = load_ours(config, state)
    attach_adapters(blocks, 0, adapters, get_family(config), config, dtype=torch.float32, device=torch.device("cpu"))
    return blocks, head


@pytest.mark.parametrize("case", list(CONFIGS))
def test_blocks_with_adapter_equal_peft_layers(case: str, tmp_path: Path):
    config, targets = CONFIGS[case]
    model, state = base_model(config)
    peft_model = save_adapter(model, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=targets)
    blocks, _ = ours_with_adapters(config, state, [str(tmp_path / "adapter")])
    ios = layer_io(peft_model, token_ids())
    assert any(isinstance(m, LoraLinear) for m in blocks[0].modules())
    with torch.no_grad(), using_adapter(str(tmp_path / "adapter")):
        for i, (block, (x, expected)) in enumerate(zip(blocks, ios, strict=True)):
            torch.testing.assert_close(block(x), expected, atol=ATOL, rtol=0, msg=lambda m: f"layer {i}: {m}")
    with torch.no_grad(), peft_model.disable_adapter():
        base_ios = layer_io(peft_model, token_ids())
    assert not torch.allclose(base_ios[-1][1], ios[-1][1], atol=1e-3), "the adapter should change the outputs"
    with torch.no_grad():  # no active adapter: the base model's layers
        for i, (block, (x, expected)) in enumerate(zip(blocks, base_ios, strict=True)):
            torch.testing.assert_close(block(x), expected, atol=ATOL, rtol=0, msg=lambda m: f"base layer {i}: {m}")


@pytest.mark.parametrize(
    "lora",
    [
        dict(r=2, lora_alpha=16),
        dict(r=8, lora_alpha=4, use_rslora=True),
        dict(r=4, lora_alpha=8, rank_pattern={"self_attn.q_proj": 6, "down_proj": 2},
             alpha_pattern={r"layers\.1\.mlp\.up_proj": 32}),
        dict(r=4, lora_alpha=8, lora_dropout=0.3, layers_to_transform=[1], target_modules=["q_proj", "v_proj"]),
    ],
    ids=["r2-alpha16", "rslora-r8-alpha4", "rank-and-alpha-patterns", "some-layers-with-dropout"],
)
def test_scaling_of_rank_alpha_rslora_and_patterns_equals_peft(lora: dict, tmp_path: Path):
    config = llama_config()
    model, state = base_model(config)
    peft_model = save_adapter(model, tmp_path / "a", **{"target_modules": LLAMA_TARGETS, **lora})
    blocks, head = ours_with_adapters(config, state, [str(tmp_path / "a")])
    ids = token_ids()
    with torch.no_grad():
        expected = peft_model(ids).logits
        with using_adapter(str(tmp_path / "a")):
            torch.testing.assert_close(run_stack(blocks, head, ids), expected, atol=LOGITS_ATOL, rtol=0)
            caches = make_caches(config, batch=2, s_max=16)  # prefill then single steps through KV caches
            steps = [run_stack(blocks, head, ids[:, s:e], position=s, caches=caches) for s, e in ((0, 9), (9, 10), (10, 15))]
            torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=LOGITS_ATOL, rtol=0)


def test_two_adapters_share_the_blocks_and_each_request_gets_its_own(tmp_path: Path):
    config = llama_config()
    model, state = base_model(config)
    first = save_adapter(model, tmp_path / "one", seed=1, r=4, lora_alpha=8, target_modules=LLAMA_TARGETS)
    ids = token_ids()
    with torch.no_grad():
        expected_one = first(ids).logits
        with first.disable_adapter():
            expected_base = first(ids).logits
    model, _ = base_model(config)
    second = save_adapter(model, tmp_path / "two", seed=2, r=2, lora_alpha=2, target_modules=["v_proj", "up_proj"])
    with torch.no_grad():
        expected_two = second(ids).logits
    blocks, head = ours_with_adapters(config, state, [str(tmp_path / "one"), str(tmp_path / "two")])
    with torch.no_grad():
        for name, expected in ((str(tmp_path / "one"), expected_one), (str(tmp_path / "two"), expected_two), (None, expected_base)):
            with using_adapter(name):
                torch.testing.assert_close(run_stack(blocks, head, ids), expected, atol=LOGITS_ATOL, rtol=0, msg=str(name))


def test_a_server_reads_only_its_own_blocks_tensors(tmp_path: Path):
    config = llama_config()
    model, _ = base_model(config)
    save_adapter(model, tmp_path / "a", r=4, lora_alpha=8, target_modules=LLAMA_TARGETS)
    updates = load_lora_adapter(str(tmp_path / "a"), get_family(config), config, range(1, 2))
    assert set(updates) == {1}
    assert sorted(updates[1]) == sorted(f"{'self_attn' if t[0] in 'qkvo' else 'mlp'}.{t}" for t in LLAMA_TARGETS)


def test_adapter_saved_as_bin_loads_the_same(tmp_path: Path):
    config = llama_config()
    model, state = base_model(config)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LLAMA_TARGETS))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    peft_model.eval().save_pretrained(tmp_path / "bin", safe_serialization=False)
    assert (tmp_path / "bin" / "adapter_model.bin").exists()
    blocks, head = ours_with_adapters(config, state, [str(tmp_path / "bin")])
    ids = token_ids()
    with torch.no_grad(), using_adapter(str(tmp_path / "bin")):
        torch.testing.assert_close(run_stack(blocks, head, ids), peft_model(ids).logits, atol=LOGITS_ATOL, rtol=0)


def test_adapter_from_a_hub_repo_fetches_only_its_config_and_weights(tmp_path: Path):
    config = llama_config()
    model, _ = base_model(config)
    save_adapter(model, tmp_path / "local", r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    hub = FakeHub(tmp_path / "local")
    assert "README.md" in hub.list_files("org/lora", revision=None, token=None, cache_dir=None)
    family = get_family(config)
    got = load_lora_adapter("org/lora", family, config, range(0, 3), cache_dir=str(tmp_path / "cache"), hub=hub)
    assert sorted(set(hub.downloads)) == ["adapter_config.json", "adapter_model.safetensors"]
    local = load_lora_adapter(str(tmp_path / "local"), family, config, range(0, 3))
    assert got.keys() == local.keys() and all(
        torch.equal(got[b][layer].A, local[b][layer].A) and torch.equal(got[b][layer].B, local[b][layer].B)
        and got[b][layer].scale == local[b][layer].scale == 2.0
        for b in local for layer in local[b]
    )


# ---------------------------------------------------------------------------------------------- unsupported
def edit_config(directory: Path, **changes: object) -> None:
    path = directory / "adapter_config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize(
    "lora, edit, message",
    [
        (dict(use_dora=True), {}, "DoRA"),
        ({}, dict(fan_in_fan_out=True), "fan_in_fan_out"),
        ({}, dict(peft_type="IA3"), "peft_type 'IA3' is not supported"),
        ({}, dict(lora_bias=True), "lora_bias"),
        (dict(modules_to_save=["lm_head"]), {}, "modules_to_save"),
        ({}, dict(init_lora_weights="pissa"), "rewrites the base weights"),
        ({}, dict(bias="all"), "trained biases"),
        (dict(target_modules=["q_proj", "embed_tokens"]), {}, "outside the 3 transformer blocks"),
        (dict(target_modules=["q_proj", "lm_head"]), {}, "'lm_head', outside the 3 transformer blocks"),
    ],
    ids=["dora", "fan_in_fan_out", "ia3", "lora_bias", "modules_to_save", "pissa", "bias-all", "embedding", "lm_head"],
)
def test_unsupported_adapters_get_a_clear_error(lora: dict, edit: dict, message: str, tmp_path: Path):
    config = llama_config()
    model, state = base_model(config)
    save_adapter(model, tmp_path / "bad", **{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **lora})
    edit_config(tmp_path / "bad", **edit)
    blocks, _ = load_ours(config, state)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        attach_adapters(blocks, 0, [str(tmp_path / "bad")], get_family(config), config,
                        dtype=torch.float32, device=torch.device("cpu"))
    assert not any(isinstance(m, LoraLinear) for b in blocks for m in b.modules())


def test_adapter_for_another_model_shape_is_refused_naming_the_layer(tmp_path: Path):
    small = llama_config()
    model, _ = base_model(llama_config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1))
    save_adapter(model, tmp_path / "other", r=4, lora_alpha=8, target_modules=["q_proj"])
    _, state = base_model(small)
    blocks, _ = load_ours(small, state)
    with pytest.raises(ValueError, match=r"at self_attn\.q_proj: .* do not fit a linear layer with in_features=64"):
        attach_adapters(blocks, 0, [str(tmp_path / "other")], get_family(small), small,
                        dtype=torch.float32, device=torch.device("cpu"))


def test_missing_adapter_directory_and_weights_are_clear_errors(tmp_path: Path):
    config = llama_config()
    blocks, _ = load_ours(config, base_model(config)[1])
    family = get_family(config)
    with pytest.raises(FileNotFoundError, match="neither an existing directory nor a valid hub repo id"):
        attach_adapters(blocks, 0, [str(tmp_path / "nope") + "//x"], family, config, dtype=torch.float32, device=torch.device("cpu"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    with pytest.raises(FileNotFoundError, match="no adapter weights"):
        attach_adapters(blocks, 0, [str(tmp_path / "empty")], family, config, dtype=torch.float32, device=torch.device("cpu"))
