"""A server that chose its blocks itself moves when a region of the model loses its servers, and only then; servers
started together spread over the model before they load (server.presence.rebalancing, server.rebalancer)."""

from __future__ import annotations

import signal
import time

import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from conftest import SERVER_ARGS, TestSwarm, wait_until
from corolla import AutoDistributedModelForCausalLM
from corolla.cli.demo_cmd import demo_model_path
from corolla.cli.local_swarm import LocalProcess

PROMPT = torch.tensor([[1, 11, 22, 33, 44]])
SPEED = ["--throughput", "10"]  # equal announced speeds make every choice below exact


def served_ranges(proc: LocalProcess) -> list[str]:
    """The A:B of every ready record the server printed (one each time it went ONLINE), in order."""
    return proc.served_ranges()


def test_rebalance_moves_server_to_blocks_left_uncovered(tiny_llama_path, tmp_path):
    with TestSwarm(env={"COROLLA_CACHE": str(tmp_path / "cache")}) as local:
        peers = local.start_dht()
        head = local.start_server(tiny_llama_path, ["--blocks", "0:2", *SERVER_ARGS, *SPEED], name="head", wait=False)
        tail = local.start_server(tiny_llama_path, ["--blocks", "2:4", *SERVER_ARGS, *SPEED], name="tail", wait=False)
        local.wait_ready(head)
        local.wait_ready(tail)
        # every block has throughput 10: the mover draws one of the two equally weak windows, and a tie never makes
        # it move
        mover = local.start_server(
            tiny_llama_path, ["--num-blocks", "2", "--balance-period", "1", *SERVER_ARGS, *SPEED], name="mover",
            verbose=True,  # DEBUG: it logs each rebalancing check
        )
        first = served_ranges(mover)
        assert first in (["0:2"], ["2:4"])
        other, leaving = ("2:4", tail) if first == ["0:2"] else ("0:2", head)
        checks = lambda: sum("rebalance.check" in line for line in list(mover.log))  # noqa: E731
        assert wait_until(lambda: checks() >= 2, timeout=30), mover.tail(60)  # two checks that found no reason to move
        assert served_ranges(mover) == first and "rebalancing" not in mover.tail(400)

        reference = LlamaForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
        expected = reference.generate(PROMPT, max_new_tokens=10, do_sample=False)
        # a client that read the swarm before the move: its cached view still has the mover on 0:2
        model = AutoDistributedModelForCausalLM.from_pretrained(tiny_llama_path, initial_peers=peers)
        try:
            assert torch.equal(model.generate(PROMPT, max_new_tokens=10), expected)

            # the server of the other span alone, not its p2pd: it announces OFFLINE for its blocks
            leaving.popen.send_signal(signal.SIGTERM)
            leaving.popen.wait(timeout=30)
            assert wait_until(lambda: served_ranges(mover) == [*first, other], timeout=20), mover.tail(60)
            assert f"rebalancing: moving from blocks {first[0]} to {other}" in mover.tail(400)

            assert torch.equal(model.generate(PROMPT, max_new_tokens=10), expected)  # re-routes by itself
        finally:
            model.shutdown()
        assert served_ranges(mover) == [*first, other]  # and it stays there


def test_two_servers_started_together_cover_the_whole_model_before_they_load(tmp_path):
    """Both used to take 0:3 of the demo model's 6 blocks, and `generate` failed with MissingBlocks until one moved
    at its first balance check (~2 minutes): now the one with the larger peer id settles on 3:6 before loading."""
    model = str(demo_model_path())
    with TestSwarm(env={"COROLLA_CACHE": str(tmp_path / "cache")}) as local:
        peers = local.start_dht()
        begin = time.monotonic()
        servers = [local.start_server(model, ["--num-blocks", "3", *SERVER_ARGS, *SPEED], name=f"s{i}", wait=False,
                                      verbose=True) for i in range(2)]
        for proc in servers:
            local.wait_ready(proc)
        ready = time.monotonic() - begin
        assert sorted(r for proc in servers for r in served_ranges(proc)) == ["0:3", "3:6"], [
            proc.tail(40) for proc in servers]
        assert ready < 60.0  # seconds, from start to both serving (no balance check involved: that takes ~120 s)
        assert sum("settle:" in line for proc in servers for line in list(proc.log)) <= 1
        client = AutoDistributedModelForCausalLM.from_pretrained(model, initial_peers=peers)
        try:
            reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
            prompt = torch.tensor([[1, 5, 9, 13]])
            expected = reference.generate(prompt, max_new_tokens=6, do_sample=False)
            assert torch.equal(client.generate(prompt, max_new_tokens=6), expected)
        finally:
            client.shutdown()
