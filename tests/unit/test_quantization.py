"""Quantized blocks (int8 / nf4 via bitsandbytes, on the CPU), their memory, dtype choice, and quant-aware routing.

Tolerances, measured on these tiny random-weight models (HF init, weights N(0, 0.02); hidden 64; 2 blocks;
input N(0, 1)), 5 seeds x 4 families (llama, mixtral, falcon, bloom), the worst case of each:

                                   int8      nf4
    block contribution (out - x)
      max |q - f| / max |f|        0.014     0.195
      ||q - f|| / ||f||            0.0095    0.155
    logits of the whole model
      1 - cosine(q, f)             4.1e-5    8.2e-3
      max |q - f| / max |f|        0.024     0.163

The asserted bounds (``TOLERANCE``) are about twice those. The block *output* includes the residual, so its
relative error is smaller still (int8 ~3e-4, nf4 ~3e-3).
"""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, BloomConfig, FalconConfig, LlamaConfig, MixtralConfig, PretrainedConfig

from corolla.client.config import ClientConfig
from corolla.client.swarm.routing import Span, find_route, uncovered_blocks, usable_servers
from corolla.client.swarm.sequence_manager import SequenceManager
from corolla.models import get_family
from corolla.protocol.errors import MissingBlocks
from corolla.protocol.messages import ServerInfo, ServerState
from corolla.server.loading.dtype_choice import checkpoint_dtype_name, resolve_dtype
from corolla.models.quantization import (
    QuantizedExperts, estimate_block_bytes, quantize_block, quantized_linear_count, quantized_weight_bytes,
    resident_bytes,
)

bnb = pytest.importorskip("bitsandbytes")

TOLERANCE = {  # see the module docstring for the measured values
    "int8": {"delta_max": 0.03, "delta_fro": 0.02, "logits_cos": 1e-4, "logits_max": 0.05},
    "nf4": {"delta_max": 0.35, "delta_fro": 0.25, "logits_cos": 2e-2, "logits_max": 0.3},
}
SMALL = dict(hidden_size=64, num_hidden_layers=2, vocab_size=128, max_position_embeddings=64)
CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**SMALL, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2),
    "mixtral": MixtralConfig(**SMALL, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                             num_local_experts=4, num_experts_per_tok=2),
    "falcon": FalconConfig(**SMALL, ffn_hidden_size=128, num_attention_heads=4, bias=True),
    "bloom": BloomConfig(vocab_size=128, hidden_size=64, n_head=4, n_layer=2),
}
# bitsandbytes linears per block: attention + MLP linears; Mixtral: 4 attention + 2 per expert (router kept)
EXPECTED_QUANTIZED = {"llama": 7, "mixtral": 4 + 2 * 4, "falcon": 4, "bloom": 4}


@functools.cache
def model_parts(family_name: str, seed: int = 0) -> tuple[PretrainedConfig, dict[str, torch.Tensor], nn.Module]:
    """(config, checkpoint state under canonical names, our client head) of a random-weight HF model."""
    config = CONFIGS[family_name]
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config).eval()
    family = get_family(config)
    state = {family.canonical_name(k): v for k, v in hf.state_dict().items()}
    head = family.head_class(config)
    head.load_hf_state_dict({k: v for k, v in state.items() if family.is_head_tensor(k)})
    return config, state, head.eval()


def blocks_of(family_name: str, mode: str, dtype: torch.dtype = torch.float32) -> list[nn.Module]:
    config, state, _ = model_parts(family_name)
    family = get_family(config)
    return [quantize_block(family.load_block(config, i, state).to(dtype).eval(), mode, "cpu", dtype)
            for i in range(family.num_blocks(config))]


def logits_through(family_name: str, blocks: list[nn.Module], ids: torch.Tensor) -> torch.Tensor:
    _, _, head = model_parts(family_name)
    hidden = head.embed(ids)  # (B, T, H)
    for block in blocks:
        hidden = block(hidden)
    return head.logits(hidden)  # (B, T, vocab)


@pytest.mark.parametrize("mode", ["int8", "nf4"])
@pytest.mark.parametrize("family_name", list(CONFIGS))
@torch.no_grad()
def test_quantized_block_stays_within_the_measured_tolerance_of_float32(family_name: str, mode: str) -> None:
    tol = TOLERANCE[mode]
    float_blocks, quant_blocks = blocks_of(family_name, "none"), blocks_of(family_name, mode)
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(1))  # (B, T, H)
    ref, out = float_blocks[0](x) - x, quant_blocks[0](x) - x  # each block's contribution, without the residual
    error = out - ref
    assert 1e-4 < (error.norm() / ref.norm()).item() < tol["delta_fro"]  # > 0: the weights really are quantized
    assert (error.abs().max() / ref.abs().max()).item() < tol["delta_max"]

    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    ref_logits, logits = logits_through(family_name, float_blocks, ids), logits_through(family_name, quant_blocks, ids)
    assert 1 - F.cosine_similarity(logits.flatten(), ref_logits.flatten(), dim=0).item() < tol["logits_cos"]
    assert ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item() < tol["logits_max"]


@pytest.mark.parametrize("mode", ["int8", "nf4"])
@torch.no_grad()
def test_quantized_block_decodes_with_a_kv_cache_as_it_runs_the_whole_sequence(mode: str) -> None:
    block = blocks_of("llama", mode)[0]
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(3))  # (B, T, H)
    kv = (torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16))  # (B, n_kv_heads, S_max, head_dim)
    steps = [block(x[:, :4], kv, 0), block(x[:, 4:5], kv, 4), block(x[:, 5:], kv, 5)]
    assert torch.allclose(torch.cat(steps, dim=1), block(x), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_nf4_block_with_odd_widths_runs_on_any_cpu(dtype: torch.dtype) -> None:
    # the demo model's shape: an MLP 688 wide, which bitsandbytes' AVX512-BF16 repacking of nf4 weights cannot take
    config = LlamaConfig(hidden_size=64, intermediate_size=688, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=16)
    torch.manual_seed(0)
    block = quantize_block(get_family(config).block_class(config, 0).to(dtype).eval(), "nf4", "cpu", dtype)
    with torch.inference_mode():  # inputs without grad: what triggers bitsandbytes' repacking
        out = block(torch.randn(1, 3, 64, dtype=dtype), None, 0)
    assert out.shape == (1, 3, 64) and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("mode", ["int8", "nf4"])
@torch.no_grad()
def test_quantized_block_computes_in_bfloat16(mode: str) -> None:
    float_block, block = blocks_of("llama", "none")[0], blocks_of("llama", mode, torch.bfloat16)[0]
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(4))
    out = block(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    ref = float_block(x)
    # bf16 rounding of the output (residual included) dominates here: measured <= 0.005 unquantized and int8,
    # <= 0.008 nf4, over 3 inputs
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 0.02


@pytest.mark.parametrize("mode", ["int8", "nf4"])
@pytest.mark.parametrize("family_name", list(CONFIGS))
def test_quantized_block_holds_bitsandbytes_linears_and_keeps_norms_and_router(family_name: str, mode: str) -> None:
    block = blocks_of(family_name, mode)[0]
    kind = bnb.nn.Linear8bitLt if mode == "int8" else bnb.nn.Linear4bit
    linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    assert quantized_linear_count(block) == EXPECTED_QUANTIZED[family_name]
    assert sum(isinstance(m, kind) for m in linears) == EXPECTED_QUANTIZED[family_name]
    weight_dtypes = {m.weight.dtype for m in linears if isinstance(m, kind)}
    assert weight_dtypes == ({torch.int8} if mode == "int8" else {torch.uint8})
    plain = [m for m in linears if not isinstance(m, kind)]
    if family_name == "mixtral":
        assert isinstance(block.mlp.experts, QuantizedExperts)
        assert plain == [block.mlp.gate] and block.mlp.gate.weight.dtype == torch.float32  # the router stays float
    else:
        assert plain == []
    norms = [m for m in block.modules() if "norm" in type(m).__name__.lower()]
    assert norms and all(p.dtype == torch.float32 for m in norms for p in m.parameters())


def test_resident_bytes_drop_by_the_expected_factor_on_the_linear_weights() -> None:
    config = LlamaConfig(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=4,
                         num_hidden_layers=1, vocab_size=128)
    family = get_family(config)
    torch.manual_seed(0)
    float_block = family.block_class(config, 0)
    linear_bytes = sum(m.weight.numel() * 4 for m in float_block.modules() if isinstance(m, nn.Linear))
    other_bytes = resident_bytes(float_block) - linear_bytes  # norms
    for mode, low, high in (("int8", 3.9, 4.0), ("nf4", 7.2, 8.0)):  # int8: 1 B + scales; nf4: 0.5 B + absmax, codebooks
        block = quantize_block(family.block_class(config, 0), mode, "cpu", torch.float32)
        quantized = resident_bytes(block) - other_bytes
        assert low < linear_bytes / quantized < high, (mode, linear_bytes / quantized)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["none", "int8", "nf4"])
@pytest.mark.parametrize("family_name", list(CONFIGS))
def test_estimated_block_bytes_from_shapes_equal_the_measured_ones(family_name: str, mode: str, dtype: torch.dtype) -> None:
    config = CONFIGS[family_name]
    family = get_family(config)
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device("meta"):
            meta_block = family.block_class(config, 0)
        block = family.block_class(config, 0)
    finally:
        torch.set_default_dtype(default)
    measured = resident_bytes(quantize_block(block, mode, "cpu", dtype))
    assert estimate_block_bytes(meta_block, mode, dtype) == measured


def test_weight_bytes_formula_matches_odd_shapes() -> None:
    for out_features, in_features in ((100, 37), (7, 300)):
        weight = torch.randn(out_features, in_features)
        for mode in ("int8", "nf4"):
            layer = nn.Linear(in_features, out_features, bias=False)
            layer.weight.data.copy_(weight)
            holder = quantize_block(nn.Sequential(layer), mode, "cpu", torch.float32)
            assert resident_bytes(holder) == quantized_weight_bytes(out_features, in_features, mode, torch.float32)


def test_unknown_quantization_mode_is_a_value_error() -> None:
    block = get_family(CONFIGS["llama"]).block_class(CONFIGS["llama"], 0)
    with pytest.raises(ValueError, match="unknown quantization mode 'int4'"):
        quantize_block(block, "int4", "cpu", torch.float32)
    with pytest.raises(ValueError, match="none, int8, nf4"):
        estimate_block_bytes(block, "fp8", torch.float32)


# ---------------------------------------------------------------- dtype choice
def test_dtype_auto_takes_the_checkpoint_dtype_on_an_accelerator_and_float32_on_cpu() -> None:
    assert resolve_dtype("auto", "bfloat16", "cpu") == ("float32", torch.float32)
    assert resolve_dtype("auto", "bfloat16", "cuda") == ("bfloat16", torch.bfloat16)
    assert resolve_dtype("auto", "float16", "cuda:0") == ("float16", torch.float16)
    assert resolve_dtype("auto", None, "cuda") == ("float32", torch.float32)  # checkpoint does not say
    assert resolve_dtype("bfloat16", "float32", "cpu") == ("bfloat16", torch.bfloat16)  # explicit wins
    assert resolve_dtype("float16", None, "cpu") == ("float16", torch.float16)
    with pytest.raises(ValueError, match="--dtype must be one of auto, float32"):
        resolve_dtype("fp8", None, "cpu")


def test_checkpoint_dtype_is_read_from_the_config() -> None:
    assert checkpoint_dtype_name(LlamaConfig(dtype=torch.bfloat16)) == "bfloat16"
    assert checkpoint_dtype_name(LlamaConfig(dtype="float16")) == "float16"
    assert checkpoint_dtype_name(object()) is None


# ---------------------------------------------------------------- records and routing
def make_info(start: int, end: int, quant: str = "none", throughput: float = 100.0) -> ServerInfo:
    return ServerInfo(
        state=ServerState.ONLINE, start_block=start, end_block=end, throughput=throughput, cache_tokens_total=1000,
        cache_tokens_free=1000, torch_dtype="float32", quant=quant, version="0", protocol_version=1,
        max_session_length=4096,
    )


def swarm(num_blocks: int, servers: dict[str, ServerInfo]) -> list[dict[str, ServerInfo]]:
    return [{p: i for p, i in servers.items() if i.start_block <= b < i.end_block} for b in range(num_blocks)]


def test_old_records_without_bytes_per_block_still_parse() -> None:
    record = make_info(0, 2).model_dump(mode="json")
    del record["bytes_per_block"]
    assert ServerInfo.model_validate(record).bytes_per_block == 0
    assert ServerInfo.model_validate({**record, "bytes_per_block": 12345}).bytes_per_block == 12345


def test_usable_servers_keep_only_the_allowed_quantizations() -> None:
    blocks = swarm(2, {"a": make_info(0, 2, "none"), "b": make_info(0, 2, "int8"), "c": make_info(0, 2, "nf4")})
    assert [p for p, _ in usable_servers(blocks, 0)] == ["a", "b", "c"]
    assert [p for p, _ in usable_servers(blocks, 0, allowed_quant=("none",))] == ["a"]
    assert [p for p, _ in usable_servers(blocks, 1, allowed_quant=("int8", "nf4"))] == ["b", "c"]
    assert [p for p, _ in usable_servers(blocks, 1, frozenset({"b"}), allowed_quant=("int8", "nf4"))] == ["c"]


def test_route_avoids_excluded_quantization_even_when_faster() -> None:
    blocks = swarm(4, {"fast-nf4": make_info(0, 4, "nf4", 1000.0), "a": make_info(0, 2), "b": make_info(2, 4)})
    assert find_route(blocks, 0, 4) == [Span("fast-nf4", 0, 4)]
    assert find_route(blocks, 0, 4, allowed_quant=("none",)) == [Span("a", 0, 2), Span("b", 2, 4)]
    only_nf4 = swarm(4, {"a": make_info(0, 2), "q": make_info(2, 4, "nf4")})
    assert find_route(only_nf4, 0, 4, allowed_quant=("none",)) is None
    assert uncovered_blocks(only_nf4, 0, 4, allowed_quant=("none",)) == [2, 3]


def test_sequence_manager_names_the_excluded_quantization_in_missing_blocks() -> None:
    manager = SequenceManager(node=None, prefix="m", num_blocks=4,  # type: ignore[arg-type]
                              config=ClientConfig(missing_blocks_wait=0.0, allowed_quant=("none",)))
    manager.block_servers = swarm(4, {"a": make_info(0, 2), "q": make_info(2, 4, "nf4")})

    async def no_update(force: bool = False) -> None:
        pass

    manager.update = no_update  # type: ignore[method-assign]
    with pytest.raises(MissingBlocks, match=r"blocks 2:4 with quantization in \('none',\).*\['nf4'\]") as error:
        asyncio.run(manager.make_route(0, 4))
    assert error.value.blocks == [2, 3]


def test_client_config_rejects_unknown_quantizations_and_accepts_a_list() -> None:
    assert ClientConfig(allowed_quant=["none", "int8"]).allowed_quant == ("none", "int8")  # type: ignore[arg-type]
    assert ClientConfig().allowed_quant is None
    for bad in (("int4",), (), "none"):
        with pytest.raises(ValueError, match="allowed_quant"):
            ClientConfig(allowed_quant=bad)  # type: ignore[arg-type]
