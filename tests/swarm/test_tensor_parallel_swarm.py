"""One server hosting the tiny Llama's 4 blocks split over two "cpu" shards, exact against the local HF model."""

from __future__ import annotations

import pytest
import torch
from conftest import TestSwarm, make_llama_checkpoint, start_named_servers, wait_until
from transformers import LlamaForCausalLM

from corolla import AutoDistributedModelForCausalLM
from corolla.client.event_loop import run_sync
from corolla.client.swarm.server_info import request_info


@pytest.fixture(scope="module")
def sharded_swarm(tmp_path_factory: pytest.TempPathFactory):
    """(distributed model, HF reference, server peer id, server log tail) with one tensor-parallel server behind it.

    The tiny Llama (4 query heads, 2 KV heads: one KV head per shard) gets a larger init than the shared one, whose
    greedy output repeats a single token and so would hide a wrong cache.
    """
    tiny_llama_path = str(make_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", initializer_range=0.2))
    log_path = tmp_path_factory.mktemp("logs") / "tensor-parallel.log"
    env = {"COROLLA_CACHE": str(tmp_path_factory.mktemp("cache"))}
    with open(log_path, "w") as log, TestSwarm(log_file=log, env=env) as local:
        args = ["--blocks", "0:4", "--tensor-parallel-devices", "cpu", "cpu"]
        swarm = start_named_servers(local, tiny_llama_path, {"tp-server": args})
        model = AutoDistributedModelForCausalLM.from_pretrained(
            tiny_llama_path, initial_peers=swarm.peers, torch_dtype=torch.float32)
        reference = LlamaForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
        try:
            yield model, reference, swarm.peer_ids["tp-server"], swarm.procs["tp-server"].tail(200)
        finally:
            model.shutdown()


def test_server_logs_its_tensor_parallel_devices(sharded_swarm):
    *_, log = sharded_swarm
    assert "tensor parallel: each block split over 2 devices: cpu cpu" in log


def test_sharded_server_logits_match_local_model(sharded_swarm):
    model, reference, *_ = sharded_swarm
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
    torch.testing.assert_close(model(ids).logits, expected, atol=1e-4, rtol=0)


def test_sharded_server_greedy_tokens_equal_hf_generate_and_cache_is_freed(sharded_swarm):
    model, reference, peer_id, _ = sharded_swarm
    ids = torch.tensor([[1, 17, 42, 99, 5, 8, 13]])
    expected = reference.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert len(set(expected[0, ids.shape[1]:].tolist())) > 5, "degenerate checkpoint: greedy output barely varies"
    assert torch.equal(model.generate(ids, max_new_tokens=10, eos_token_id=None), expected)

    def cache_free() -> bool:
        info = run_sync(request_info(model.swarm_node.p2p, peer_id)).info
        return info.cache_tokens_free == info.cache_tokens_total

    assert wait_until(cache_free, timeout=10), "the session's cache was not released"


def test_a_quantized_tensor_parallel_server_announces_int8_and_stays_close_to_hf(tmp_path_factory, tiny_llama_path):
    """--quant int8 with --tensor-parallel-devices cpu cpu: each shard quantized; logits within the int8 bounds of
    tests/unit/test_quantization.py (1 - cosine < 1e-4, max |q - f| / max |f| < 0.05)."""
    log_path = tmp_path_factory.mktemp("logs") / "tensor-parallel-int8.log"
    env = {"COROLLA_CACHE": str(tmp_path_factory.mktemp("cache"))}
    with open(log_path, "w") as log, TestSwarm(log_file=log, env=env) as local:
        args = ["--blocks", "0:4", "--quant", "int8", "--tensor-parallel-devices", "cpu", "cpu"]
        swarm = start_named_servers(local, tiny_llama_path, {"tp-int8-server": args})
        model = AutoDistributedModelForCausalLM.from_pretrained(
            tiny_llama_path, initial_peers=swarm.peers, torch_dtype=torch.float32)
        try:
            info = run_sync(request_info(model.swarm_node.p2p, swarm.peer_ids["tp-int8-server"])).info
            ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(2))
            with torch.no_grad():
                logits = model(ids).logits
        finally:
            model.shutdown()
    reference = LlamaForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(ids).logits
    assert info.quant == "int8" and 0 < info.bytes_per_block
    cosine = torch.nn.functional.cosine_similarity(logits.flatten(), expected.flatten(), dim=0).item()
    assert 1 - cosine < 1e-4
    assert 0 < ((logits - expected).abs().max() / expected.abs().max()).item() < 0.05
