"""Quantized servers in a real swarm: the announced mode and block bytes, and clients that require or accept them.

One swarm: a DHT peer, an nf4 server and an unquantized one, both holding all 4 blocks of the tiny Llama.
nf4 tolerance: on this 4-block random-weight model, nf4 blocks run in-process give logits with 1 - cosine
0.013-0.015 and max |q - f| / max |f| 0.15-0.16 against HF (3 inputs); asserted: < 3e-2 and < 0.3.
"""

from __future__ import annotations

import json
import signal

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from conftest import TestSwarm, run_corolla, start_named_servers
from corolla import AutoDistributedModelForCausalLM
from corolla.client.config import ClientConfig
from corolla.protocol.errors import MissingBlocks

NF4_LOGITS_COS, NF4_LOGITS_MAX = 3e-2, 0.3


@pytest.fixture(scope="module")
def quant_swarm(tiny_llama_path: str, tmp_path_factory: pytest.TempPathFactory):
    log_path = tmp_path_factory.mktemp("logs") / "quant-swarm.log"
    with open(log_path, "w") as log, TestSwarm(log_file=log, env={"COROLLA_CACHE": str(tmp_path_factory.mktemp("cache"))}) as local:
        yield start_named_servers(local, tiny_llama_path, {
            "nf4": ["--blocks", "0:4", "--quant", "nf4"],
            "plain": ["--blocks", "0:4"],
        })


@pytest.fixture(scope="module")
def reference(tiny_llama_path: str):
    return LlamaForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


def swarm_logits(swarm, ids: torch.Tensor, **config: object) -> torch.Tensor:
    model = AutoDistributedModelForCausalLM.from_pretrained(
        swarm.model_path, initial_peers=swarm.peers, torch_dtype=torch.float32,
        client_config=ClientConfig(missing_blocks_wait=1.0, **config),  # type: ignore[arg-type]
    )
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        model.shutdown()


def test_status_shows_each_servers_quantization_and_measured_block_bytes(quant_swarm, reference):
    result = run_corolla("status", "--initial-peers", *quant_swarm.peers, "--model", quant_swarm.model_path, "--json")
    assert result.returncode == 0, result.stderr
    by_peer = {s["peer_id"]: s for s in json.loads(result.stdout)["servers"]}
    nf4, plain = by_peer[quant_swarm.peer_ids["nf4"]], by_peer[quant_swarm.peer_ids["plain"]]
    assert (nf4["quant"], plain["quant"]) == ("nf4", "none")
    float_block_bytes = sum(p.numel() * 4 for p in reference.model.layers[0].parameters())
    assert plain["bytes_per_block"] == float_block_bytes  # float32 weights, nothing else
    assert 0 < nf4["bytes_per_block"] < float_block_bytes / 3  # tiny layers: the codebooks weigh in (see README)


def test_client_requiring_unquantized_blocks_is_exact(quant_swarm, reference):
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = reference(ids).logits
    assert torch.allclose(swarm_logits(quant_swarm, ids, allowed_quant=("none",)), expected, atol=1e-4, rtol=0)


def test_without_unquantized_servers_a_strict_client_gets_missing_blocks_and_others_use_nf4(quant_swarm, reference):
    quant_swarm.local.kill(quant_swarm.procs["plain"], signal.SIGTERM)  # announces OFFLINE on its way out
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(6))
    with pytest.raises(MissingBlocks, match=r"blocks 0:4 with quantization in \('none',\).*nf4") as error:
        swarm_logits(quant_swarm, ids, allowed_quant=("none",))
    assert error.value.blocks == [0, 1, 2, 3]

    with torch.no_grad():
        expected = reference(ids).logits
    logits = swarm_logits(quant_swarm, ids)  # any quantization: the nf4 server
    assert (logits - expected).abs().max().item() > 1e-4  # really computed by quantized blocks
    assert 1 - F.cosine_similarity(logits.flatten(), expected.flatten(), dim=0).item() < NF4_LOGITS_COS
    assert ((logits - expected).abs().max() / expected.abs().max()).item() < NF4_LOGITS_MAX
