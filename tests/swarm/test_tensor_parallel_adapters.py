"""One server with ``--tensor-parallel-devices cpu cpu --adapters DIR``: a peft LoRA adapter sliced over the shards,
exact against the local peft model, and the base model from the same server for a client without the adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TestSwarm, make_llama_checkpoint, start_named_servers
from peft import PeftModel
from test_adapters import peft_logits, save_random_lora
from transformers import LlamaForCausalLM

from corolla import AutoDistributedModelForCausalLM


@pytest.fixture(scope="module")
def sharded_lora_swarm(tmp_path_factory: pytest.TempPathFactory):
    """(client with the adapter, client without, the peft model) around one tensor-parallel server."""
    root = tmp_path_factory.mktemp("tp-lora")
    base = str(make_llama_checkpoint(root / "tiny-llama", seed=3, initializer_range=0.2))
    adapter = str(root / "my-lora")
    save_random_lora(Path(base), Path(adapter))
    log_path = tmp_path_factory.mktemp("logs") / "tensor-parallel-lora.log"
    with open(log_path, "w") as log, TestSwarm(log_file=log, env={"COROLLA_CACHE": str(root / "cache")}) as local:
        args = ["--blocks", "0:4", "--tensor-parallel-devices", "cpu", "cpu", "--adapters", adapter]
        peers = start_named_servers(local, base, {"tp-lora-server": args}).peers
        peft_model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval(), adapter).eval()
        with_adapter = AutoDistributedModelForCausalLM.from_pretrained(
            base, initial_peers=peers, torch_dtype=torch.float32, active_adapter=adapter)
        without = AutoDistributedModelForCausalLM.from_pretrained(base, initial_peers=peers, torch_dtype=torch.float32)
        try:
            yield with_adapter, without, peft_model
        finally:
            with_adapter.shutdown()
            without.shutdown()


def test_sharded_server_with_adapter_equals_peft_and_serves_the_base_model_too(sharded_lora_swarm):
    with_adapter, without, peft_model = sharded_lora_swarm
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(5))
    expected, expected_base = peft_logits(peft_model, ids)
    torch.testing.assert_close(with_adapter(ids).logits, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(without(ids).logits, expected_base, atol=1e-4, rtol=0)
    prompt = torch.tensor([[1, 17, 42, 99, 5]])  # prefill, then cached single-token steps through the shards
    assert torch.equal(with_adapter.generate(prompt, max_new_tokens=10, eos_token_id=None),
                       peft_model.generate(input_ids=prompt, max_new_tokens=10, do_sample=False, eos_token_id=None))
