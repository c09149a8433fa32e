"""Which backend serves what (models/registry.py): our blocks first, the generic backend for every other
decoder-only type whose layers fit, clear refusals naming what does not fit; checkpoints written by transformers
load into generic blocks and heads through the server's and client's loading path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from generic_cases import case_config, generic_case, one_thread  # noqa: F401
from reference import ATOL, make_reference, run_stack, token_ids
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from corolla.checkpoint import load_config, load_tensors
from corolla.models import UnsupportedModelError, get_family
from corolla.models.generic import GenericBlock, GenericClientHead
from corolla.models.llama import LlamaBlock
from corolla.models.registry import BACKEND_ENV, supported_model_types

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=2,
            vocab_size=128)


@pytest.mark.parametrize(("model_type", "overrides", "reason"), [
    ("deepseek_v3", {}, "multi-head latent attention"),
    ("qwen3_next", {}, r"non-K/V state \(layer types linear_attention: a hybrid\)"),
    ("jamba", {}, "non-K/V state"),
    ("falcon_h1", {}, "non-K/V state"),
    ("llama4_text", {}, "chunked local attention"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "bidirectional attention"),
    ("t5", {}, "encoder-decoder"),
    ("gpt2", {}, "no `layers` list of decoder layers"),
    ("gpt_neox", {}, r"GPTNeoXLayer.forward takes no cache or past_key_values"),
])
def test_types_that_do_not_fit_are_refused_naming_what_is_missing(model_type: str, overrides: dict, reason: str) -> None:
    config = AutoConfig.for_model(model_type, **overrides)
    with pytest.raises(UnsupportedModelError, match=f"'{model_type}' is not supported: .*{reason}") as info:
        get_family(config)
    listed = str(info.value).split("supported model types: ")[1].split(", ")
    assert listed == sorted(listed) and {"llama", "qwen3_moe", "gemma3_text", "gpt_oss"} <= set(listed)


def test_our_own_blocks_stay_the_fast_path_and_the_environment_can_force_the_generic_backend(monkeypatch) -> None:
    config = LlamaConfig(**TINY)
    assert get_family(config).block_class is LlamaBlock
    monkeypatch.setenv(BACKEND_ENV, "generic")
    family = get_family(config)
    assert family.name == "generic" and family.block_class is GenericBlock
    monkeypatch.setenv(BACKEND_ENV, "fastest")
    with pytest.raises(ValueError, match="COROLLA_BACKEND='fastest'; choose one of auto, generic"):
        get_family(config)


@torch.no_grad()
def test_our_llama_block_and_the_generic_backend_agree_on_one_llama_checkpoint(monkeypatch) -> None:
    config = LlamaConfig(**TINY)
    reference = make_reference(config)
    state = reference.state_dict()
    ours = get_family(config)
    monkeypatch.setenv(BACKEND_ENV, "generic")
    generic = get_family(LlamaConfig(**TINY))
    outputs = []
    for family in (ours, generic):
        canonical = {family.canonical_name(k): v for k, v in state.items()}
        blocks = [family.load_block(config, i, canonical).eval() for i in range(2)]
        head = family.head_class(config)
        head.load_hf_state_dict({k: v for k, v in canonical.items() if family.is_head_tensor(k)})
        outputs.append(run_stack(blocks, head, token_ids()))
    torch.testing.assert_close(outputs[0], outputs[1], atol=ATOL, rtol=0)
    torch.testing.assert_close(outputs[1], reference(token_ids()).logits, atol=ATOL, rtol=0)


def test_supported_model_types_lists_ours_and_the_verified_generic_types() -> None:
    types = supported_model_types()
    assert types == tuple(sorted(types))
    assert {"llama", "mixtral", "bloom", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "olmo2", "granite",
            "cohere", "cohere2", "gpt_oss"} <= set(types)


@pytest.mark.parametrize("case_id", ["qwen3_moe", "gpt_oss", "gemma3_text", "granite"])
@torch.no_grad()
def test_a_saved_checkpoint_loads_into_generic_blocks_and_head_as_servers_and_clients_read_it(
        case_id: str, tmp_path: Path) -> None:
    """``save_pretrained`` writes hub layouts (Qwen3-MoE: one tensor per expert, which transformers fuses on load);
    blocks read only their own tensors, renamed by the family, and convert them as transformers does."""
    reference, _, _ = generic_case(case_id)
    reference.save_pretrained(tmp_path)
    config = load_config(str(tmp_path))
    family = get_family(config)
    stored = load_tensors(str(tmp_path), lambda name: True, dtype=torch.float32)
    if case_id == "qwen3_moe":
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in stored  # the per-expert hub layout
    blocks = []
    for index in range(family.num_blocks(config)):
        prefix = family.block_prefix(index)
        tensors = load_tensors(str(tmp_path), lambda name, p=prefix: name.startswith(p), dtype=torch.float32,
                               rename=family.canonical_name)
        blocks.append(family.load_block(config, index, tensors).eval())
    head = family.head_class(config)
    head.load_hf_state_dict(load_tensors(str(tmp_path), family.is_head_tensor, dtype=torch.float32,
                                         rename=family.canonical_name))
    ids = token_ids()
    torch.testing.assert_close(run_stack(blocks, head, ids), reference(ids).logits, atol=ATOL, rtol=0)


def test_a_block_refuses_a_checkpoint_missing_a_tensor_and_changes_nothing() -> None:
    _, blocks, _ = generic_case("qwen3_moe")
    block = blocks[0]
    state = {f"layer.{k}": v.clone() for k, v in block.layer.state_dict().items()}
    del state["layer.mlp.experts.down_proj"]
    before = {k: v.clone() for k, v in block.state_dict().items()}
    with pytest.raises(ValueError, match=r"missing keys \['mlp.experts.down_proj'\]"):
        block.load_hf_state_dict(state)
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items())


def test_a_tied_head_reads_no_lm_head_and_an_untied_one_needs_it() -> None:
    tied, untied = case_config("granite"), case_config("olmo2")
    assert tied.tie_word_embeddings and not untied.tie_word_embeddings
    head = GenericClientHead(tied)
    assert head.lm_head.weight is head.embed_tokens.weight
    reference = AutoModelForCausalLM.from_config(untied)
    state = {k: v for k, v in reference.state_dict().items() if get_family(untied).is_head_tensor(k)}
    del state["lm_head.weight"]
    with pytest.raises(ValueError, match=r"missing keys \['lm_head.weight'\]"):
        GenericClientHead(untied).load_hf_state_dict(state)


def test_the_readme_lists_exactly_what_corolla_models_prints() -> None:
    from corolla.models.registry import models_table

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    listed = readme.split("<!-- corolla models -->\n")[1].split("\n<!-- /corolla models -->")[0]
    assert listed == models_table()


def test_tensor_parallelism_is_refused_for_the_generic_backend() -> None:
    from corolla.server.compute.tensor_parallel import check_tensor_parallel

    config = case_config("qwen3_moe")
    with pytest.raises(ValueError, match="tensor parallelism is not supported for generic"):
        check_tensor_parallel(get_family(config), config, ["cpu", "cpu"])


def test_corolla_models_prints_the_table_and_answers_help() -> None:
    from conftest import run_corolla
    from corolla.models.registry import models_table

    printed = run_corolla("models")
    assert printed.returncode == 0 and printed.stdout.rstrip("\n") == models_table()
    helped = run_corolla("models", "--help")
    assert helped.returncode == 0 and "usage: corolla models" in helped.stdout
