"""LoRA adapters over a real swarm, against the local peft model.

Three servers: A (blocks 0:2) and B (2:4) preload a peft adapter with ``--adapters DIR``; C (0:2) has no adapter
and announces a huge throughput, so every route that may use it does. A client asking for the adapter must go
A -> B; a client without one goes C -> B, so B serves both the adapter and the base model.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaForCausalLM

from conftest import TestSwarm, make_llama_checkpoint, start_named_servers
from corolla import AutoDistributedModelForCausalLM
from corolla.client.config import ClientConfig
from corolla.client.swarm.connection import Connection
from corolla.client.event_loop import run_sync
from corolla.client.swarm.server_info import request_info
from corolla.protocol import PROTOCOL_VERSION
from corolla.protocol.errors import MissingBlocks, RemoteError
from corolla.protocol.messages import BlockRange, OpenSession

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_lora(base_path: Path, directory: Path) -> None:
    """A peft LoRA adapter of the checkpoint at ``base_path`` with random nonzero weights (peft zeroes lora_B)."""
    model = get_peft_model(LlamaForCausalLM.from_pretrained(base_path, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS))
    torch.manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.1)
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def lora_swarm(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lora")
    base = make_llama_checkpoint(root / "tiny-llama", seed=3)
    adapter = str(root / "my-lora")
    save_random_lora(base, Path(adapter))
    log_path = tmp_path_factory.mktemp("logs") / "lora-swarm.log"
    with open(log_path, "w") as log, TestSwarm(log_file=log, env={"COROLLA_CACHE": str(root / "cache")}) as local:
        swarm = start_named_servers(local, str(base), {
            "a": ["--blocks", "0:2", "--adapters", adapter],
            "b": ["--blocks", "2:4", "--adapters", adapter],
            "c": ["--blocks", "0:2", "--throughput", "1000000"],
        })
        yield swarm, adapter


@pytest.fixture(scope="module")
def peft_model(lora_swarm):
    swarm, adapter = lora_swarm
    base = LlamaForCausalLM.from_pretrained(swarm.model_path, dtype=torch.float32).eval()
    return PeftModel.from_pretrained(base, adapter).eval()


@pytest.fixture(scope="module")
def clients(lora_swarm):
    """One client with the adapter and one without, each with its own DHT node."""
    swarm, adapter = lora_swarm
    with_adapter = AutoDistributedModelForCausalLM.from_pretrained(
        swarm.model_path, initial_peers=swarm.peers, torch_dtype=torch.float32, active_adapter=adapter)
    base = AutoDistributedModelForCausalLM.from_pretrained(swarm.model_path, initial_peers=swarm.peers, torch_dtype=torch.float32)
    yield with_adapter, base
    with_adapter.shutdown()
    base.shutdown()


@pytest.fixture(autouse=True)
def caches_are_released_and_servers_alive(lora_swarm):
    yield
    lora_swarm[0].assert_clean()


def test_servers_announce_their_adapters(clients, lora_swarm):
    swarm, adapter = lora_swarm
    announced = {name: run_sync(request_info(clients[1].swarm_node.p2p, peer)).info.adapters for name, peer in swarm.peer_ids.items()}
    assert announced == {"a": (adapter,), "b": (adapter,), "c": ()}


def peft_logits(peft_model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits with the adapter, logits of the base model) of peft's model for ids; checks the adapter matters."""
    with torch.no_grad():
        expected = peft_model(ids).logits
        with peft_model.disable_adapter():
            base_logits = peft_model(ids).logits
    assert not torch.allclose(expected, base_logits, atol=1e-2), "the adapter should change the logits"
    return expected, base_logits


def test_logits_and_greedy_tokens_with_the_adapter_equal_peft(clients, peft_model):
    with_adapter, _ = clients
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(5))
    expected, _ = peft_logits(peft_model, ids)
    assert torch.allclose(with_adapter(ids).logits, expected, atol=1e-4, rtol=0)
    prompt = torch.tensor([[1, 17, 42, 99, 5]])
    assert torch.equal(with_adapter.generate(prompt, max_new_tokens=12),
                       peft_model.generate(input_ids=prompt, max_new_tokens=12, do_sample=False))


def test_a_client_without_adapter_gets_the_base_model_from_the_same_servers(clients, peft_model):
    _, base = clients
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), peft_model.disable_adapter():
        expected = peft_model(ids).logits
        expected_tokens = peft_model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    assert torch.allclose(base(ids).logits, expected, atol=1e-4, rtol=0)
    assert torch.equal(base.generate(ids, max_new_tokens=8), expected_tokens)


def test_an_unknown_adapter_is_a_clear_error(clients, lora_swarm):
    swarm, _ = lora_swarm
    client = AutoDistributedModelForCausalLM.from_pretrained(
        swarm.model_path, initial_peers=swarm.peers, active_adapter="no-such-lora",
        client_config=ClientConfig(missing_blocks_wait=0.5))
    try:
        with pytest.raises(MissingBlocks, match=r"blocks 0:4 with the LoRA adapter 'no-such-lora'"):
            client.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2)
    finally:
        client.shutdown()
    # a client that asks a server directly is refused before any cache is reserved
    connection = run_sync(Connection.open(clients[1].swarm_node.p2p, swarm.peer_ids["a"], "inference", timeout=10))
    try:
        async def open_with_unknown_adapter():
            await connection.send(OpenSession(protocol_version=PROTOCOL_VERSION, blocks=BlockRange(start=0, end=2),
                                              max_length=8, active_adapter="no-such-lora"))
            return await connection.receive(10)

        with pytest.raises(RemoteError, match=r"bad_request: adapter 'no-such-lora' is not loaded on this server"):
            run_sync(open_with_unknown_adapter())
    finally:
        connection.close()


def test_concurrent_sessions_with_and_without_the_adapter_both_stay_exact(clients, peft_model):
    prompts = [torch.tensor([[1, 9, 8, 7, 6]]), torch.tensor([[1, 50, 60, 70]])]
    expected = [peft_model.generate(input_ids=prompts[0], max_new_tokens=16, do_sample=False)]
    with peft_model.disable_adapter():
        expected.append(peft_model.generate(input_ids=prompts[1], max_new_tokens=16, do_sample=False))
    results: list[torch.Tensor | BaseException | None] = [None, None]
    start = threading.Barrier(2)

    def run(i: int) -> None:
        try:
            start.wait(timeout=30)
            with clients[i].inference_session(max_length=32) as session:
                results[i] = clients[i].generate(prompts[i], max_new_tokens=16, session=session)
        except BaseException as e:  # reported by the assertion below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(isinstance(r, torch.Tensor) for r in results), results
    assert torch.equal(results[0], expected[0]) and torch.equal(results[1], expected[1])


def test_a_session_selects_its_own_adapter_on_a_base_client(clients, peft_model, lora_swarm):
    """`inference_session(..., active_adapter=...)` picks the adapter per session; the client's other sessions
    stay on the base model."""
    _, base = clients
    _, adapter = lora_swarm
    prompt = torch.tensor([[1, 23, 9, 77, 4, 61]])
    expected = peft_model.generate(input_ids=prompt, max_new_tokens=10, do_sample=False)
    with peft_model.disable_adapter():
        expected_base = peft_model.generate(input_ids=prompt, max_new_tokens=10, do_sample=False)
    assert not torch.equal(expected, expected_base), "the adapter should change the greedy tokens"
    with base.inference_session(max_length=32, active_adapter=adapter) as session:
        assert torch.equal(base.generate(prompt, max_new_tokens=10, session=session), expected)
        assert all(s.peer_id != lora_swarm[0].peer_ids["c"] for s in session.route)
    assert torch.equal(base.generate(prompt, max_new_tokens=10), expected_base)
