"""LoRA adapters, the pure parts: peft config -> scales, peft tensor names -> our blocks, routing to servers that
hold an adapter, and running compute steps with a request's adapter (batched only with the same adapter)."""

from __future__ import annotations

import asyncio
import math
import random
import threading

import pytest
from transformers import BloomConfig, LlamaConfig

from corolla.client.swarm.routing import Span, find_route, sample_route, uncovered_blocks
from corolla.models import get_family
from corolla.models.lora import active_adapter
from corolla.protocol.messages import ServerInfo, ServerState
from corolla.server.compute.adapter_calls import AdapterCalls
from corolla.server.loading.adapters import LoraTarget, map_lora_names, parse_lora_config
from corolla.server.compute.worker import PRIORITY_INFERENCE, ComputeWorker

LLAMA = get_family(LlamaConfig())
BLOOM = get_family(BloomConfig())


# ------------------------------------------------------------------------------------------------ config
def test_scale_is_alpha_over_rank_or_over_sqrt_rank_with_rslora():
    assert parse_lora_config({"peft_type": "LORA", "r": 4, "lora_alpha": 8}, "a").scale_of("model.layers.0.mlp.up_proj") == 2.0
    rs = parse_lora_config({"peft_type": "LORA", "r": 9, "lora_alpha": 6, "use_rslora": True}, "a")
    assert rs.scale_of("model.layers.0.mlp.up_proj") == 2.0


def test_rank_and_alpha_patterns_match_module_ends_like_peft():
    settings = parse_lora_config({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8,
        "rank_pattern": {"q_proj": 2, r"layers\.1\.mlp\.up_proj": 16}, "alpha_pattern": {"up_proj": 64},
    }, "a")
    assert settings.rank_of("model.layers.0.self_attn.q_proj") == 2
    assert settings.scale_of("model.layers.0.self_attn.q_proj") == 4.0  # 8 / 2
    assert settings.scale_of("model.layers.1.mlp.up_proj") == 4.0  # 64 / 16
    assert settings.scale_of("model.layers.0.mlp.up_proj") == 16.0  # 64 / 4
    assert settings.scale_of("model.layers.0.self_attn.k_proj") == 2.0
    assert settings.rank_of("model.layers.0.self_attn.xq_proj") == 4  # a pattern matches whole name parts only
    rs = parse_lora_config({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_rslora": True, "rank_pattern": {"v_proj": 16}}, "a")
    assert math.isclose(rs.scale_of("model.layers.0.self_attn.v_proj"), 2.0)


@pytest.mark.parametrize("raw, message", [
    ({"peft_type": "PREFIX_TUNING"}, "peft_type 'PREFIX_TUNING' is not supported"),
    ({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": True}, "DoRA"),
    ({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"peft_type": "LORA", "r": 4}, "malformed LoRA config"),
    ({"peft_type": "LORA", "r": 0, "lora_alpha": 8}, "ranks must be >= 1"),
])
def test_unsupported_or_malformed_configs_name_the_problem(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_lora_config(raw, "adapter 'x'")


# ------------------------------------------------------------------------------------------------ names
def peft_names(*modules: str) -> list[str]:
    return [f"base_model.model.{m}.lora_{ab}.weight" for m in modules for ab in "AB"]


def test_peft_names_map_to_blocks_and_our_layer_paths():
    names = peft_names("model.layers.0.self_attn.q_proj", "model.layers.11.mlp.down_proj", "model.layers.1.mlp.up_proj")
    assert map_lora_names(names, LLAMA, 12, "a") == {
        "model.layers.0.self_attn.q_proj": LoraTarget("model.layers.0.self_attn.q_proj", 0, "self_attn.q_proj"),
        "model.layers.1.mlp.up_proj": LoraTarget("model.layers.1.mlp.up_proj", 1, "mlp.up_proj"),
        "model.layers.11.mlp.down_proj": LoraTarget("model.layers.11.mlp.down_proj", 11, "mlp.down_proj"),
    }


def test_bloom_names_saved_without_the_transformer_prefix_are_canonicalised():
    targets = map_lora_names(peft_names("h.2.self_attention.query_key_value"), BLOOM, 4, "a")
    assert targets == {"h.2.self_attention.query_key_value": LoraTarget("h.2.self_attention.query_key_value", 2, "self_attention.query_key_value")}


@pytest.mark.parametrize("names, message", [
    (peft_names("model.layers.4.mlp.up_proj"), "adapts 'model.layers.4.mlp.up_proj', outside the 4 transformer blocks"),
    (peft_names("lm_head"), "adapts 'lm_head', outside"),
    (["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"], r"lack lora_A or lora_B"),
    (["base_model.model.model.layers.0.mlp.up_proj.lora_magnitude_vector"], "a DoRA magnitude"),
    (["base_model.model.model.layers.0.mlp.up_proj.bias"], "not a lora_A/lora_B weight"),
    ([], "holds no LoRA weights"),
])
def test_names_we_cannot_serve_are_refused(names, message):
    with pytest.raises(ValueError, match=message):
        map_lora_names(names, LLAMA, 4, "adapter 'x'")


# ------------------------------------------------------------------------------------------------ routing
def make_info(start: int, end: int, adapters: tuple[str, ...] = (), throughput: float = 100.0) -> ServerInfo:
    return ServerInfo(
        state=ServerState.ONLINE, start_block=start, end_block=end, throughput=throughput, cache_tokens_total=1000,
        cache_tokens_free=1000, torch_dtype="float32", version="0", protocol_version=1, max_session_length=4096,
        adapters=adapters,
    )


def swarm(num_blocks: int, servers: dict[str, ServerInfo]) -> list[dict[str, ServerInfo]]:
    return [{p: i for p, i in servers.items() if i.start_block <= b < i.end_block} for b in range(num_blocks)]


def test_routes_with_an_adapter_use_only_servers_that_announce_it():
    blocks = swarm(4, {
        "fast": make_info(0, 4, throughput=1000),  # no adapter: best for the base model only
        "a": make_info(0, 2, ("lora-x",)), "b": make_info(2, 4, ("lora-y", "lora-x")), "c": make_info(2, 4, ("lora-y",)),
    })
    assert find_route(blocks, 0, 4) == [Span("fast", 0, 4)]
    assert find_route(blocks, 0, 4, adapter="lora-x") == [Span("a", 0, 2), Span("b", 2, 4)]
    assert sample_route(blocks, 0, 4, random.Random(0), adapter="lora-x") == [Span("a", 0, 2), Span("b", 2, 4)]
    assert find_route(blocks, 0, 4, adapter="lora-y") is None
    assert uncovered_blocks(blocks, 0, 4, adapter="lora-y") == [0, 1]
    assert uncovered_blocks(blocks, 0, 4, adapter="unknown") == [0, 1, 2, 3]
    assert find_route(blocks, 0, 4, adapter="lora-x", banned={"b"}) is None


def test_server_records_without_adapters_still_parse():
    raw = make_info(0, 2).model_dump(mode="json")
    del raw["adapters"]
    assert ServerInfo.model_validate(raw).adapters == ()
    assert ServerInfo.model_validate(make_info(0, 2, ("d/x",)).model_dump(mode="json")).adapters == ("d/x",)


# ------------------------------------------------------------------------------------------------ serving
def test_unknown_adapter_is_named_with_the_ones_held():
    calls = AdapterCalls(["lora-x", "/data/lora-y"])
    assert calls.problem(None) is None and calls.problem("lora-x") is None
    assert calls.problem("nope") == "adapter 'nope' is not loaded on this server (its adapters: 'lora-x', '/data/lora-y')"
    assert AdapterCalls([]).problem("nope") == "adapter 'nope' is not loaded on this server (its adapters: none)"


def test_decode_steps_batch_only_with_steps_of_the_same_adapter_and_run_with_it_active():
    calls = AdapterCalls(["x", "y"])
    seen: list[tuple[str | None, list[str]]] = []
    release = threading.Event()

    def decode(items):
        seen.append((active_adapter(), list(items)))
        return items

    assert calls.bind(decode, None) is decode and calls.bind(decode, "x") is calls.bind(decode, "x")
    worker = ComputeWorker()

    async def scenario():
        blocker = asyncio.ensure_future(worker.run(PRIORITY_INFERENCE, release.wait, 5.0))
        await asyncio.sleep(0.05)  # the thread is now inside the blocker
        steps = [
            asyncio.ensure_future(worker.run_batched(PRIORITY_INFERENCE, calls.bind(decode, adapter), (0, 4, adapter), item))
            for adapter, item in [("x", "x1"), (None, "n1"), ("y", "y1"), ("x", "x2"), (None, "n2")]
        ]
        await asyncio.sleep(0.05)
        release.set()
        await blocker
        return await asyncio.gather(*steps)

    try:
        outputs = asyncio.run(scenario())
    finally:
        worker.shutdown()
    assert outputs == ["x1", "n1", "y1", "x2", "n2"]
    assert seen == [("x", ["x1", "x2"]), (None, ["n1", "n2"]), ("y", ["y1"])]
    assert active_adapter() is None
